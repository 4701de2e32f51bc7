"""The benchmark scripts' inputs and outputs (benchmarks/): bad input is one ``error:`` line on stderr, exit code 2,
before any long work (a tester's list: each of these had ended in a traceback, run for minutes on input it then
refused, or silently measured something else); every script's ``--help`` says what it does in a whole sentence,
and its ``--json`` object names it. Nothing here loads a model: the scripts stop at their checks."""
from __future__ import annotations

import ast
import importlib.util
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "bench_args.py")
SESSION = BENCH / "gpu_session.sh"


def run_script(script: str, *args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def assert_one_error(r: subprocess.CompletedProcess, message: str) -> None:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error") or ": error:" in line]
    assert r.returncode == 2 and r.stdout == "" and len(errors) == 1, r.stderr
    assert message in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def load(name: str, monkeypatch):
    """benchmarks/NAME.py imported as a module, with its folder on the path as a script has it."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- bad input: one line, exit code 2, before the work -----------------------------------------------------
@pytest.mark.parametrize("script,args,message", [
    # a CPU-only torch: torch's own AssertionError's traceback
    pytest.param("kernel_timing.py", ["--device", "cuda"], "error: --device cuda: no CUDA device here",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device here")),
    ("kernel_timing.py", ["--repeats", "0"], "argument --repeats: '0': must be 1 or more"),  # (0 meant the default)
    ("kernel_timing.py", ["--device", "cpu", "--sweep"], "error: --sweep: times the Triton decode kernel's settings"),
    # 2,246 tokens of text: transformers failed on prompts of unequal length, after the model had loaded
    ("runtime_throughput.py", ["--prompt-tokens", "3000", "--batch-sizes", "1", "--repeats", "1"],
     "error: --prompt-tokens 3000: the prompt text gives at most"),
    # a prompt and its sampled token beyond the context: "scheduler made no progress" after the model loaded
    ("block_fill_steps.py", ["--steps", "8"], "error: --steps 8: fewer than a block (16 tokens)"),
    ("eviction_steps.py", ["--tokens", "64", "8192"],
     "error: --tokens 8192: a prefill of at most 8191 tokens fits smollm2-135m's context of 8192"),
    ("eviction_steps.py", ["--budgets", "32", "8000"], "error: --budgets 8000: at most 7952"),
    ("eviction_steps.py", ["--policy", "streaming"], "argument --policy: invalid choice: 'streaming'"),
    ("block_fill_steps.py", ["--prompt", "8000", "--steps", "500"], "error: --prompt 8000 --steps 500: more tokens"),
    ("step_tokens.py", ["--tokens", "8192", "--rounds", "1"],
     "error: --tokens 8192: a prefill of at most 8191 tokens fits smollm2-135m's context of 8192"),
    ("search_efficiency.py", ["--code", "", "--scenarios", "chat-capacity"], "argument --code: '': empty"),
    ("sampler_variants.py", ["--code", ""], "argument --code: '': empty"),  # (an empty one meant this source's)
    # exit code 1 and no "error:"; both scripts stopped at the first scenario without a table, after the
    # scenarios before it had been searched: every scenario is checked first
    ("search_efficiency.py", ["--code", "bogus", "--scenarios", "chat-capacity"],
     "error: --code bogus: no table cached for chat-capacity (run benchmarks/search_efficiency.py at that source"),
    ("sampler_variants.py", ["--code", "bogus", "--scenarios", "chat-capacity", "agent-energy"],
     "error: --code bogus: no table cached for chat-capacity, agent-energy"),
    # printed at once, then the other revision's replay under valgrind ran on for a minute
    ("sim_instructions.py", ["--base", "nonexistentrev"], "error: --base nonexistentrev: not a git revision"),
    ("sim_instructions.py", ["--base", "HEAD", "--profile", "/nonexistent.json"],
     "argument --profile: /nonexistent.json: no such file"),
    ("sim_instructions.py", ["--base", "HEAD", "--config", "/nonexistent.yaml"],
     "error: --config /nonexistent.yaml: /nonexistent.yaml: cannot read config"),
    ("sim_memory.py", ["--base", "HEAD", "--new", "HEAD"], "error: --base and --new are both HEAD"),
    ("idle_wake.py", ["--rounds", "0"], "argument --rounds: '0': must be 1 or more"),
    ("token_gaps.py", ["--top", "0"], "argument --top: '0': must be 1 or more"),
    ("sim_memory.py", ["--base", "nonexistentrev"], "error: --base nonexistentrev: not a git revision"),
    ("quality_kv.py", ["--only", ","], "argument --only: ',' names nothing"),  # (it meant every config)
    ("quality_heldout.py", ["--config", "eviction.policy"], "error: --config 'eviction.policy': 'eviction.policy' "
     "is not knob=value"),
    ("quality_heldout.py", ["--config", "eviction.policy=lru"], "error: eviction.policy"),
])
def test_bad_input_is_one_line_and_exit_code_2(script, args, message):
    assert_one_error(run_script(script, *args), message)


def test_a_file_as_the_cache_folder_is_refused_before_any_grid_is_scored(tmp_path):
    """It had scored 3,528 configs (70 s) and then failed to save them (FileExistsError), losing the work."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    r = run_script("search_efficiency.py", "--cache-dir", str(not_a_folder / "tables"), "--scenarios", "chat-capacity")
    assert_one_error(r, f"argument --cache-dir: {not_a_folder / 'tables'}: {not_a_folder} is not a folder")
    r = run_script("search_efficiency.py", "--cache-dir", str(not_a_folder), "--scenarios", "chat-capacity")
    assert_one_error(r, f"argument --cache-dir: {not_a_folder}: not a folder")


# ---- gpu_session.sh ------------------------------------------------------------------------------------------
@pytest.fixture
def checkout(tmp_path):
    """The folders gpu_session.sh expects at the repository's root, and the script, in a scratch folder."""
    root = tmp_path / "repo"
    for folder in ("skistune", "runtime", "kernels", "searchspace", "benchmarks"):
        (root / folder).mkdir(parents=True)
    shutil.copy(SESSION, root / "benchmarks" / "gpu_session.sh")
    return root


def fake_tools(folder: Path, gpu: bool) -> dict:
    """An environment whose nvidia-smi answers as a machine with (or without) a GPU, and whose PYTHON is a stub
    that records the skistune/ links each step sees (so the session runs in a second, measuring nothing)."""
    folder.mkdir()
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + ("echo 'GPU 0: fake'\n" if gpu else "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"))
    python = folder / "python-stub"
    python.write_text('#!/bin/sh\nls skistune >> "$STUB_LOG"\n')
    for f in (smi, python):
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}", "PYTHON": str(python),
            "STUB_LOG": str(folder / "seen.txt")}


def session(checkout: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/gpu_session.sh", *args], capture_output=True, text=True, cwd=checkout,
                          env=env, timeout=120)


def test_gpu_session_help_is_a_usage_text_and_runs_nothing(checkout):
    for flag in ("-h", "--help"):
        r = session(checkout, flag)
        assert r.returncode == 0 and r.stdout.startswith("usage:") and "OUT_DIR" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in (checkout / "skistune").iterdir()) == []  # (no links left, none made)
    assert not (checkout / "--help").exists()  # (it had been taken as the output folder)


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "error: unknown option --bogus"),
    (["a", "b"], "error: one OUT_DIR at most, not 2 arguments"),
    (["out"], "error: no NVIDIA GPU here (nvidia-smi -L failed)"),
])
def test_gpu_session_refuses_in_one_line_before_doing_anything(checkout, tmp_path, args, message):
    r = session(checkout, *args, env=fake_tools(tmp_path / "bin", gpu=False))
    assert r.returncode == 2 and r.stdout == "" and r.stderr.splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith(message), r.stderr
    assert sorted(p.name for p in checkout.iterdir()) == ["benchmarks", "kernels", "runtime", "searchspace",
                                                          "skistune"]
    assert list((checkout / "skistune").iterdir()) == []


def test_gpu_session_links_the_package_layout_only_while_it_runs(checkout, tmp_path):
    """The installed layout's links in skistune/ are there for the steps and gone when the session exits (a
    tester's checkout had kept them as untracked files)."""
    env = fake_tools(tmp_path / "bin", gpu=True)
    r = session(checkout, str(tmp_path / "out"), env=env)
    assert r.returncode == 0, r.stderr
    assert "kernels" in Path(env["STUB_LOG"]).read_text().split()  # (a step saw the links)
    assert {"runtime", "kernels", "searchspaces"} <= set(Path(env["STUB_LOG"]).read_text().split())
    assert list((checkout / "skistune").iterdir()) == []
    assert (tmp_path / "out" / "gpu.txt").is_file()


# ---- --help, --json and the "benchmark" key ------------------------------------------------------------------
def test_description_is_the_docstrings_first_sentence(monkeypatch):
    bench_args = load("bench_args", monkeypatch)
    doc = """Simulator cost in CPU instructions, two revisions side by side: a figure on a machine whose
speed moves (e.g. a shared VM read the same code 20-30% apart). More follows.

    python benchmarks/x.py
"""
    assert bench_args.description(doc) == ("Simulator cost in CPU instructions, two revisions side by side: a figure "
                                           "on a machine whose speed moves (e.g. a shared VM read the same code "
                                           "20-30% apart).")
    assert bench_args.description("One line.\n    python x.py [--json]\n") == "One line."
    assert bench_args.description("No full stop\nthen the usage:\n    python x.py\n") == "No full stop then the usage:"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_script_shares_the_description_and_json_option_and_names_itself(script, monkeypatch):
    """``--help`` had shown only the docstring's first line (mid-sentence in nine scripts), ``--json`` had no
    help in seven, and three scripts' JSON had no "benchmark" key."""
    bench_args = load("bench_args", monkeypatch)
    tree = ast.parse(script.read_text())
    described = bench_args.description(ast.get_docstring(tree, clean=False))
    assert described.endswith((".", ")")) and len(described) > 40, described
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    parsers = [c for c in calls if getattr(c.func, "attr", None) == "ArgumentParser"]
    assert parsers and all(ast.unparse(k.value) == "description(__doc__)" for p in parsers for k in p.keywords
                           if k.arg == "description"), script.name
    assert any(getattr(c.func, "id", None) == "add_json" for c in calls), script.name
    assert not any(getattr(c.func, "attr", None) == "add_argument" and c.args
                   and getattr(c.args[0], "value", None) == "--json" for c in calls), script.name
    prints = [c for c in calls if getattr(c.func, "id", None) == "print_json"]
    assert prints, script.name
    assigned = {a.targets[0].id: a.value for a in ast.walk(tree)
                if isinstance(a, ast.Assign) and isinstance(a.targets[0], ast.Name)}
    for call in prints:
        figures = call.args[0]
        figures = assigned.get(figures.id, figures) if isinstance(figures, ast.Name) else figures  # (sim_identity's)
        assert isinstance(figures, ast.Dict), f"{script.name}: print_json's argument is not a dict literal"
        named = {ast.literal_eval(k): ast.unparse(v) for k, v in zip(figures.keys, figures.values) if k is not None}
        assert named.get("benchmark") == repr(script.stem), script.name


def test_help_shows_the_whole_first_sentence_and_the_json_help():
    r = run_script("sim_instructions.py", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "one run to the next in wall time)." in text, r.stdout
    assert "--json end with the figures as one JSON object on the last line" in text, r.stdout


def test_piped_tables_are_200_columns_wide(monkeypatch):
    """rich's 80 columns wrapped the tables of tuned_vs_default, search_efficiency and sampler_variants mid-row
    in a pipe; a terminal keeps its own width and COLUMNS still decides."""
    bench_args = load("bench_args", monkeypatch)
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # (not a terminal, as a pipe)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert bench_args.console().width == 200 and bench_args.console(stderr=True).width == 200
    monkeypatch.setenv("COLUMNS", "100")
    assert bench_args.console().width == 100


# ---- what the scripts measure and print ----------------------------------------------------------------------
def test_kernel_timing_prints_slow_bandwidths_with_significant_digits(monkeypatch):
    """A CPU's quantize-on-append (below 1 GB/s) had printed as 0 GB/s."""
    kernel_timing = load("kernel_timing", monkeypatch)
    assert [kernel_timing.gbps(x) for x in (0.2e9, 0.0642e9, 27.46e9, 3350e9)] == ["0.2", "0.0642", "27.5", "3350"]


def test_fidelity_steps_groups_account_for_every_step(monkeypatch):
    """The replay's first step follows nothing: it had been in neither "after an idle gap" nor "back to back",
    whose counts then fell a step short of the replay's (49 of 50)."""
    fidelity_steps = load("fidelity_steps", monkeypatch)
    rows = [{"kind": "prefill", "predicted_s": 1.0, "measured_s": 1.0, "after_idle": False},
            {"kind": "decode", "predicted_s": 1.1, "measured_s": 1.0, "after_idle": True},
            {"kind": "decode", "predicted_s": 0.9, "measured_s": 1.0, "after_idle": False},
            {"kind": "mixed", "predicted_s": 1.0, "measured_s": 1.0, "after_idle": False}]
    groups = fidelity_steps.step_groups(rows)
    by_gap = ("first step", "after an idle gap", "back to back")
    assert [groups[g]["steps"] for g in by_gap] == [1, 1, 2]
    assert sum(groups[g]["steps"] for g in by_gap) == sum(groups[k]["steps"] for k in ("prefill", "decode", "mixed"))


def test_optimize_phases_stores_its_study_in_a_folder_it_removes_and_labels_a_reused_replay(monkeypatch, tmp_path,
                                                                                              capsys):
    """It had left skistune-phases-<n>.db in the working folder, and printed the baseline's replay as a third
    one where `validate` had reused a candidate's (the same wall time to the bit)."""
    import skistune.optimize as opt

    optimize_phases = load("optimize_phases", monkeypatch)
    for name, module_name in optimize_phases.PHASES.items():  # (the script wraps them: restored after the test)
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, name, getattr(module, name))
    seen = {}
    base, other = object(), object()

    def optimize(slo, storage, study_name):
        seen["storage"] = storage
        path = Path(storage.removeprefix("sqlite:///"))
        path.write_text("")  # (as SQLite would make it)
        v = SimpleNamespace(role="candidate", config=base, wall_s=4.9, holds=True)
        return SimpleNamespace(validated=[v, SimpleNamespace(role="candidate", config=other, wall_s=5.2, holds=False),
                                          SimpleNamespace(**{**vars(v), "role": "baseline"})])

    monkeypatch.setattr(opt, "optimize", optimize)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["optimize_phases.py", "--json"])
    optimize_phases.main()
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    assert seen["storage"].startswith("sqlite:///") and not Path(seen["storage"].removeprefix("sqlite:///")).exists()
    assert "replay (candidate): 4.9 s, holds" in out
    assert "replay (baseline): candidate 1's replay reused (4.9 s, not replayed again), holds" in out
    assert '"reused_from_candidate":1' in out.splitlines()[-1]


def test_step_tokens_times_each_size_as_one_step(monkeypatch):
    """The default config's 512-token chunks had made --tokens 1024 2048 two 512-token steps."""
    step_tokens = load("step_tokens", monkeypatch)
    b = step_tokens.one_step_prefill(4096).batching
    assert not b.chunked_prefill and b.max_num_batched_tokens >= 4097


@pytest.mark.slow
def test_step_tokens_times_prefills_beside_decodes_and_prints_the_profiles_prediction():
    """Each prefill beside 0 and 1 decoding sequences, one step each (the script stops if a step held other
    work), with the shipped profile's prediction of that step."""
    import json

    r = run_script("step_tokens.py", "--tokens", "4", "9", "--rounds", "1", "--decodes", "0", "1",
                   "--profile", "cpu-smollm2-135m", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.splitlines()[-1])["rows"]
    assert sorted((row["tokens"], row["decodes"]) for row in rows) == [(4, 0), (4, 1), (9, 0), (9, 1)]
    assert all(row["median_ms"] > 0 and row["predicted_ms"] > 0 for row in rows)
    predicted = {(row["tokens"], row["decodes"]): row["predicted_ms"] for row in rows}
    assert all(predicted[n, 1] > predicted[n, 0] for n in (4, 9))  # (a decode beside a chunk costs its term)


@pytest.mark.slow
def test_block_fill_steps_splits_the_decode_steps_that_complete_a_block():
    """16 decode steps from a 40-token prompt: the 8th writes the third block's last token (slot 47)."""
    import json

    r = run_script("block_fill_steps.py", "--steps", "16", "--bits", "16", "4", "--profile", "cpu-smollm2-135m",
                   "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.splitlines()[-1])["rows"]
    assert [(row["bits"], row["kind"], row["steps"]) for row in rows] == [
        (16, "completes a block", 1), (16, "completes none", 15), (4, "completes a block", 1), (4, "completes none", 15)]
    assert all(row["median_ms"] > 0 and row["predicted_ms"] > 0 for row in rows)


def test_bench_args_types(monkeypatch, tmp_path):
    bench_args = load("bench_args", monkeypatch)
    import argparse

    assert bench_args.writable_dir(str(tmp_path / "new" / "deeper")) == str(tmp_path / "new" / "deeper")
    (tmp_path / "f").write_text("")
    for bad in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a folder"):
            bench_args.writable_dir(str(bad))
    with pytest.raises(argparse.ArgumentTypeError, match="empty"):
        bench_args.nonempty("  ")
    with pytest.raises(argparse.ArgumentTypeError, match="names nothing"):
        bench_args.name_list(["a", "b"])(" , ")
    assert bench_args.name_list(["a", "b"])("b,") == ["b"]


# ---- tuned_vs_default's measured capacity ------------------------------------------------------------------
@pytest.mark.parametrize("midpoints,expected", [(1, 2 ** 0.5), (2, 2 ** 0.75)])
def test_measured_capacity_judges_every_constraint_the_replay_broke(monkeypatch, midpoints, expected):
    """A replay above the predicted capacity, whose prediction breaks the SLO as well, counted as held
    (validation's `holds` leaves such constraints out as untested): the benchmark measured the baseline and
    the tuned config at the same highest rate it tried. The runtime here breaks TBT above 1.8x the slice's rate,
    and the prediction breaks it everywhere."""
    tvd = load("tuned_vs_default", monkeypatch)
    replayed = []

    def fake_measure(problem, runtime, predicted, requests, role):
        replayed.append(predicted.rate_scale)
        binding = ["tbt:p99<=200ms"] if predicted.rate_scale > 1.8 else []
        return SimpleNamespace(holds=True, measured=SimpleNamespace(binding=binding, figures={"tbt_p99_s": 0.1}),
                               wall_s=1.0)

    monkeypatch.setattr(tvd, "score_at", lambda problem, config, requests, scale: SimpleNamespace(rate_scale=scale))
    monkeypatch.setattr(tvd, "_measure", fake_measure)
    m = tvd.measured_capacity(None, None, None, SimpleNamespace(base_rps=1.0), 1.0, midpoints=midpoints)
    assert m["capacity_rps"] == pytest.approx(expected) and m["bounded"]
    assert replayed[:2] == [1.0, 2.0] and len(replayed) == 2 + midpoints


def test_a_benchmarks_profile_may_be_a_shipped_one_by_name(monkeypatch):
    """`skistune optimize --profile cpu-smollm2-135m` works; the benchmarks' --profile had said "no such file"."""
    import argparse

    bench_args = load("bench_args", monkeypatch)
    assert Path(bench_args.hardware_profile("cpu-smollm2-135m")).resolve() == \
        (ROOT / "profiles" / "cpu-smollm2-135m.json").resolve()
    with pytest.raises(argparse.ArgumentTypeError, match=r"did you mean cpu-smollm2-135m\?"):
        bench_args.hardware_profile("cpu-smollm2-13")
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        bench_args.hardware_profile("/nonexistent.json")


def _recorded_run(profile: Path, speed: list[dict]) -> dict:
    """A fidelity run's --json output as `fidelity.py --measured` reads it: one replay of four bursty-chat requests."""
    measured = {"ttft p50": 0.1, "ttft p99": 0.2, "tbt p50": 0.05, "tbt p99": 0.08, "e2e p50": 1.0, "e2e p99": 1.5,
                "tok/s": 10.0, "kv peak": 1 << 20}
    return {"benchmark": "fidelity", "model": "smollm2-135m", "device": "cpu", "profile": str(profile),
            "requests": 4, "rate_scale": 1.0, "machine_speed": speed,
            "rows": [{"workload": "bursty-chat", "config": c, "measured": measured, "preemptions": [0, 0]}
                     for c in ("default", "seqs4")]}


def test_fidelity_predicts_again_at_the_speed_its_checks_timed(tmp_path):
    """A replay's error splits into the machine's drift since its profile and the simulator's own: every replay
    is predicted again with the profile's steps at the speed the run's checks timed, per kind the geometric mean
    of before and after. Checks that read the profile's own speed leave every prediction as it was."""
    import json

    profile = ROOT / "profiles" / "cpu-smollm2-135m.json"

    def run(speed):
        path = tmp_path / "run.json"
        path.write_text(json.dumps(_recorded_run(profile, speed)) + "\n")
        r = run_script("fidelity.py", "--measured", str(path), "--profile", str(profile), "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1]), r.stdout

    same = [{"when": w, "ratio": 1.0, "by_kind": {"decode": 1.0, "prefill": 1.0}} for w in ("before", "after")]
    out, _ = run(same)
    assert out["at_checked_speed"]["factors"] == {"decode": 1.0, "prefill": 1.0}
    assert all(r["predicted_at_speed"] == r["predicted"] and r["errors_at_speed"] == r["errors"] for r in out["rows"])
    drift = [{"when": "before", "ratio": 2.0, "by_kind": {"decode": 4.0, "prefill": 1.0}},
             {"when": "after", "ratio": 2.0, "by_kind": {"decode": 1.0, "prefill": 1.0}}]
    out, text = run(drift)
    speed = out["at_checked_speed"]
    assert speed["factors"] == pytest.approx({"decode": 2.0, "prefill": 1.0}) and speed["other"] == pytest.approx(2.0)
    assert "at the speed its checks timed (decode x2.000, prefill x1.000)" in text
    for r in out["rows"]:  # decode steps twice as long: every token gap after the first grows
        assert r["predicted_at_speed"]["tbt p50"] > 1.5 * r["predicted"]["tbt p50"]
    import statistics

    errors = [abs(e) for r in out["rows"] for e in r["errors_at_speed"].values()]
    assert speed["median_abs_error"] == statistics.median(errors)
    assert speed["runs"] == 2 and speed["latency_figures"] == 12
    # --check-each: each replay at the speed of the checks around it, not the run's two ends
    around = [{"when": w, "ratio": 1.0, "by_kind": {"decode": d, "prefill": 1.0}}
              for w, d in (("before", 1.0), ("before bursty-chat seqs4", 1.0), ("after", 4.0))]
    record = _recorded_run(profile, around)
    for row, checks in zip(record["rows"], ([0, 1], [1, 2])):
        row["checks"] = checks
    (tmp_path / "each.json").write_text(json.dumps(record) + "\n")
    r = run_script("fidelity.py", "--measured", str(tmp_path / "each.json"), "--profile", str(profile), "--json")
    assert r.returncode == 0, r.stderr
    first, second = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    assert first["predicted_at_speed"] == first["predicted"]  # (decode x1.0 before and after it)
    assert second["predicted_at_speed"]["tbt p50"] > 1.5 * second["predicted"]["tbt p50"]  # (x1.0, x4.0: x2.0)
    assert "around each replay (from 3 checks" in r.stdout
    # checks of another profile say nothing of this one: none applied
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_recorded_run(tmp_path / "elsewhere.json", drift)) + "\n")
    r = run_script("fidelity.py", "--measured", str(other), "--profile", str(profile), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["at_checked_speed"] is None


def test_token_gaps_pairs_each_gap_with_its_request_and_token(monkeypatch):
    token_gaps = load("token_gaps", monkeypatch)
    records = [SimpleNamespace(request_id="a", token_times_s=[1.0, 1.5, 1.75]),
               SimpleNamespace(request_id="b", token_times_s=[2.0])]  # (one token: no gap)
    assert token_gaps.token_gaps(records) == {("a", 1): (0.5, 1.0), ("a", 2): (0.25, 1.5)}
