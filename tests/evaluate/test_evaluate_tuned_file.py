"""`skistune evaluate` on a tuned file: what a tester found in its note on the workload the figures are for (a hint
that dropped --rate, --workload-seed, --max-input and every other workload option, and wrote a trace as
"FILE (azure)" with --requests, neither of which evaluate takes; "the same workload" told by the source's text,
so the same trace under another path spelling got a false note and a preset that now draws other requests got
none), and the model it recorded, which evaluate ignored while export used it."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from skistune.cli import app
from skistune.evaluate import options_command, preset_options, tuned_workload_note, workload_options
from skistune.workloads import load_workload

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")
SEARCH = ("--slo", "p99=200ms", "--trials", "2", "--validate", "0", "--profile", PROFILE)
TUNED_NOTE = "the config's predicted figures (its provenance) are for "
TINY = ("--requests", "3", "--max-input", "32", "--max-output", "2")


def _optimize(*args: str) -> dict:
    r = CliRunner().invoke(app, ["optimize", *SEARCH, *args])
    assert r.exit_code == 0, r.output
    return yaml.safe_load(Path("skistune-tuned.yaml").read_text())["provenance"]


def _evaluate(config, *args: str, profile: str = PROFILE):
    return CliRunner().invoke(app, ["evaluate", str(config), "--profile", profile, *args, "--json"])


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def _tuned_note(result) -> str | None:
    notes = [n for n in _json(result)["notes"] if n.startswith(TUNED_NOTE)]
    assert len(notes) <= 1
    return notes[0] if notes else None


def _hint(note: str) -> list[str]:
    """The options the note says to evaluate with, as a shell splits them when pasted."""
    assert note.endswith(")"), note
    return shlex.split(note.rsplit("evaluate that workload (", 1)[1][:-1])


def _same_figures(result, predicted: dict) -> None:
    """The figures a tuned file's provenance records (latencies to 4 significant digits, the KV peak whole)."""
    metrics = _json(result)["metrics"]
    assert metrics["ttft_s"]["p99"] == pytest.approx(predicted["ttft_p99_s"], rel=5e-4)
    assert metrics["tbt_s"]["p99"] == pytest.approx(predicted["tbt_p99_s"], rel=5e-4)
    assert metrics["kv_peak_bytes"] == predicted["kv_peak_bytes"]


def _azure_trace(path: Path, rows: int = 40) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{i // 2:02d}.{5 * (i % 2)}000000,{100 + 37 * i % 900},{5 + 7 * i % 40}"
              for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- the tuned file records the options that built its workload ----

def test_the_hint_carries_every_workload_option_and_pasted_reproduces_the_figures(tmp_path, monkeypatch):
    """The hint had been `--workload chat --requests N --rate-scale X` whatever optimize was given: --rate 0.5,
    --workload-seed 3 and --max-input 512 dropped, so the pasted command predicted other figures and printed the
    note again."""
    monkeypatch.chdir(tmp_path)
    prov = _optimize("--requests", "20", "--rate", "0.5", "--workload-seed", "3", "--max-input", "512")
    assert prov["workload"]["options"] == {"workload": "chat", "workload-seed": 3, "requests": 20, "rate": 0.5,
                                           "max-input": 512}
    scale = prov["predicted"]["rate_scale"]
    note = _tuned_note(_evaluate("skistune-tuned.yaml", "--requests", "200"))
    hint = _hint(note)
    assert hint == ["--workload", "chat", "--workload-seed", "3", "--requests", "20", "--rate", "0.5", "--max-input",
                    "512", "--rate-scale", repr(scale)]
    again = _evaluate("skistune-tuned.yaml", *hint)
    assert _tuned_note(again) is None
    _same_figures(again, prov["predicted"])


def test_a_preset_tuned_without_requests_records_optimizes_count_not_evaluates(tmp_path, monkeypatch):
    """Optimize's preset default is 100 requests, evaluate's 2,000: the file says 100 so the hint can."""
    monkeypatch.chdir(tmp_path)
    prov = _optimize("--objective", "memory", "--rate", "0.02", "--max-output", "8")
    assert prov["workload"]["options"] == {"workload": "chat", "requests": 100, "rate": 0.02, "max-output": 8}
    assert prov["predicted"]["rate_scale"] == 1.0
    hint = _hint(_tuned_note(_evaluate("skistune-tuned.yaml", "--requests", "200")))
    assert hint == ["--workload", "chat", "--requests", "100", "--rate", "0.02", "--max-output", "8"]
    again = _evaluate("skistune-tuned.yaml", *hint)
    assert _tuned_note(again) is None
    _same_figures(again, prov["predicted"])


def test_optimizes_own_rate_scale_is_folded_into_the_hints(tmp_path, monkeypatch):
    """Evaluate has one --rate-scale: the hint's is optimize's times the prediction's, and the digest is compared
    at optimize's."""
    monkeypatch.chdir(tmp_path)
    prov = _optimize("--requests", "20", "--rate-scale", "0.5")
    assert prov["workload"]["options"] == {"workload": "chat", "requests": 20, "rate-scale": 0.5}
    hint = _hint(_tuned_note(_evaluate("skistune-tuned.yaml", "--requests", "20")))
    assert hint == ["--workload", "chat", "--requests", "20", "--rate-scale", repr(0.5 * prov["predicted"]["rate_scale"])]
    again = _evaluate("skistune-tuned.yaml", *hint)
    assert _tuned_note(again) is None
    _same_figures(again, prov["predicted"])


def test_a_trace_is_recorded_by_its_absolute_path_and_the_hint_works_from_any_folder(tmp_path, monkeypatch):
    """A trace's hint had been `--workload 'FILE (azure)' --requests 30`, refused twice by evaluate (no such file;
    --requests applies to presets only); and the same trace by another path spelling had a false note."""
    traces = tmp_path / "traces"
    traces.mkdir()
    trace = _azure_trace(traces / "t.csv")
    monkeypatch.chdir(traces)
    prov = _optimize("--workload", "./t.csv", "--first", "30", "--max-input", "256")
    assert prov["workload"]["options"] == {"workload": str(trace), "first": 30, "max-input": 256}
    scale = repr(prov["predicted"]["rate_scale"])
    tuned = traces / "skistune-tuned.yaml"
    # the same requests under another spelling of the path, at the recorded rate: nothing to say
    same = _evaluate(tuned, "--workload", "t.csv", "--first", "30", "--max-input", "256", "--rate-scale", scale)
    assert _tuned_note(same) is None
    _same_figures(same, prov["predicted"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    hint = _hint(_tuned_note(_evaluate(tuned, *TINY)))
    assert hint == ["--workload", str(trace), "--first", "30", "--max-input", "256", "--rate-scale", scale]
    again = _evaluate(tuned, *hint)
    assert _tuned_note(again) is None
    _same_figures(again, prov["predicted"])


def test_the_python_api_records_the_options_that_built_its_workload_and_none_for_one_changed_after(tmp_path):
    """The API is given the workload, not its options: `load_workload`'s own arguments are recorded (checked by
    the digest of what they build); a workload changed after it, or built otherwise, records none."""
    import skistune
    from skistune.workloads import first_n, synthesize

    def options(workload):
        result = skistune.optimize(workload, slo="p99=200ms", profile=PROFILE, n_trials=1, validate=0,
                                   storage=f"sqlite:///{tmp_path / 's.db'}", study_name=f"s{len(workload)}")
        return result.provenance()["workload"].get("options")

    assert options("chat") == {"workload": "chat", "requests": 100}
    assert options(load_workload("chat", requests=20, max_input=512)) == {"workload": "chat", "requests": 20,
                                                                         "max-input": 512}
    assert options(first_n(load_workload("chat", requests=30), 10)) is None
    assert options(first_n(synthesize("chat", requests=40), 12)) is None


def test_preset_options_names_only_what_rebuilds_the_same_requests():
    assert preset_options(load_workload("chat", requests=30)) == {"workload": "chat", "requests": 30}
    assert preset_options(load_workload("code", requests=30, seed=4)) == {"workload": "code", "workload-seed": 4,
                                                                          "requests": 30}
    assert preset_options(load_workload("chat", requests=30, max_input=512)) == {"workload": "chat", "requests": 30,
                                                                                 "max-input": 512}
    assert preset_options(load_workload("chat", requests=30, rate_rps=0.12345)) == {"workload": "chat", "requests": 30,
                                                                                    "rate": 0.12345}
    assert preset_options(load_workload(load_workload("chat", requests=30), first=10)) is None  # (built from one)


def test_evaluates_hint_for_a_file_written_in_python_composes_its_rate_scales(tmp_path):
    """A tester's file from `load_workload(..., rate_scale=0.04)`, searched at x8 its rate: the hint asked for
    `--rate-scale 8.0`, which the command line cannot put after x0.04; x0.32 reproduces the figures."""
    import skistune

    result = skistune.optimize(load_workload("chat", requests=20, max_input=256, rate_scale=0.04), slo="p99=200ms",
                               profile=PROFILE, n_trials=2, validate=0, storage=f"sqlite:///{tmp_path / 's.db'}")
    tuned = tmp_path / "tuned.yaml"
    result.write(tuned)
    scale = 0.04 * yaml.safe_load(tuned.read_text())["provenance"]["predicted"]["rate_scale"]
    note = " ".join(_evaluate(tuned).stderr.split())
    assert f"--workload chat --requests 20 --max-input 256 --rate-scale {scale!r}" in note


# ---- the options, as recorded and as a command ----

def test_workload_options_keep_what_was_given_that_is_not_a_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert workload_options("chat", requests=100, rate=None, skip_bad_rows=False, workload_seed=0,
                            length_scale=1.0, rate_scale=1.0) == {"workload": "chat", "requests": 100}
    assert workload_options("./t.csv", format="azure", skip_bad_rows=True, window="0:600", jitter=0.25) == {
        "workload": str(tmp_path / "t.csv"), "format": "azure", "skip-bad-rows": True, "jitter": 0.25,
        "window": "0:600"}
    with pytest.raises(TypeError, match="unknown option"):
        workload_options("chat", seed=3)  # (optimize's --seed is the search's: the workload's is workload_seed)


def test_options_command_uses_evaluates_option_names():
    options = {"workload": "/a b/t.csv", "format": "azure", "skip-bad-rows": True, "workload-seed": 2,
               "block-tokens": 32, "jitter": 0.1, "window": "0:600", "sample": 9, "length-scale": 0.5,
               "burstiness": 2.0, "rate-scale": 2.0}
    assert options_command(options, 0.25) == ("--workload '/a b/t.csv' --format azure --skip-bad-rows "
                                              "--workload-seed 2 --block-tokens 32 --jitter 0.1 --window 0:600 "
                                              "--sample 9 --length-scale 0.5 --burstiness 2.0 --rate-scale 0.25")
    assert options_command({"workload": "chat", "requests": 100}, 1.0) == "--workload chat --requests 100"
    help_text = CliRunner().invoke(app, ["evaluate", "--help"], terminal_width=200).output
    for option in ("--format", "--skip-bad-rows", "--workload-seed", "--block-tokens", "--jitter", "--window",
                   "--sample", "--length-scale", "--burstiness", "--rate-scale", "--requests", "--rate",
                   "--first", "--max-input", "--max-output"):
        assert option in help_text


# ---- the same workload is the same digest ----

def _provenance(w, digest: str, rate_scale: float = 0.5, options=None) -> dict:
    workload = {"source": w.source, "digest": digest, "requests": len(w), "transforms": list(w.transforms)}
    return {"workload": {**workload, **({"options": options} if options else {})},
            "predicted": {"rate_scale": rate_scale}}


def test_a_preset_that_now_draws_other_requests_is_noted_though_its_source_reads_the_same():
    """An old file (no options recorded) whose preset now draws other requests: its source text is this
    workload's, which had been taken for the same requests (no note at all)."""
    w = load_workload("chat", requests=100)
    note = tuned_workload_note(_provenance(w, "282ccc0dc1104c17"), w, 0.5)
    assert note == (f"{TUNED_NOTE}100 requests of {w.source} (digest 282ccc0dc1104c17) at x0.5 its rate; this is 100 "
                    f"requests of {w.source} (digest {w.digest()}) at x0.5: these are the options that built the "
                    "workload tuned on, but they now build other requests (it was made by an earlier skistune), so "
                    "its figures will not be matched exactly")
    recorded = {"workload": "chat", "requests": 100}  # (a file that records them, evaluated with the same)
    assert tuned_workload_note(_provenance(w, "282ccc0dc1104c17", options=recorded), w, 1.0, recorded).endswith(
        "so its figures will not be matched exactly (they were predicted at --rate-scale 0.5)")
    assert tuned_workload_note(_provenance(w, w.digest(), options=recorded), w, 0.5, recorded) is None


def test_the_same_requests_under_another_source_text_are_the_same_workload(tmp_path):
    trace = _azure_trace(tmp_path / "t.csv")
    w = load_workload(trace, first=30)
    tuned = {**_provenance(w, w.digest()), "workload": {**_provenance(w, w.digest())["workload"],
                                                        "source": "./t.csv (azure)"}}
    assert tuned_workload_note(tuned, w, 0.5) is None
    assert tuned_workload_note(tuned, w, 1.0).endswith("to check them, evaluate these requests at --rate-scale 0.5")


def test_a_file_without_options_suggests_no_command_for_another_workload():
    """The Python API given a Workload, or an earlier skistune: what is known (the digest), and no command that
    could not rebuild it."""
    tuned = _provenance(load_workload("chat", requests=100, max_input=300), "0123456789abcdef")
    note = tuned_workload_note(tuned, load_workload("chat", requests=20), 1.0)
    assert "--workload" not in note and "digest 0123456789abcdef" in note
    assert note.endswith("the file does not record the workload options that built those requests (made by an "
                         "earlier skistune, or by the Python API from a Workload): the workload of that digest at "
                         "--rate-scale 0.5 reproduces them (`skistune workload show` prints a workload's digest)")
    del tuned["workload"]["digest"]  # (a provenance written by hand)
    assert tuned_workload_note(tuned, load_workload("chat", requests=20), 1.0).endswith(
        "(no digest recorded) at x0.5 its rate; this is 20 requests of preset:chat requests=20 seed=0 rate_rps=5.53 "
        f"burstiness=1.09 block_tokens=16 (digest {load_workload('chat', requests=20).digest()}) at x1: the file "
        "records neither the workload options that built those requests nor their digest")


# ---- the model the file was tuned for ----

def _tuned_for(tmp_path, model: str) -> Path:
    path = tmp_path / "kv.yaml"
    path.write_text(f"offload: {{device_memory_fraction: 0.5}}\nprovenance:\n  model: {model}\n")
    return path


def test_evaluate_takes_the_model_the_tuned_file_records_as_export_does(tmp_path):
    """A file tuned for llama-3-8b had been evaluated for smollm2-135m, with no word of it."""
    config = _tuned_for(tmp_path, "llama-3-8b")
    result = _evaluate(config, *TINY, profile="cuda-llama-3-8b-quick")
    out = _json(result)
    assert out["model"] == "llama-3-8b" and out["notes"] == []
    # (said on stderr before anything is measured or loaded for that model, which may fail on this machine)
    assert (f"note: evaluating for llama-3-8b, the model {config} was tuned for (its provenance; --model names "
            "another)") in result.stderr
    assert _json(_evaluate(config, *TINY, "--model", "llama-3-8b", profile="cuda-llama-3-8b-quick"))["notes"] == []
    plain = tmp_path / "plain.yaml"
    plain.write_text("{}\n")
    assert _json(_evaluate(plain, *TINY))["model"] == "smollm2-135m"  # (none recorded: the default)


def test_another_model_than_the_recorded_one_is_a_one_line_note(tmp_path):
    config = _tuned_for(tmp_path, "llama-3-8b")
    r = _evaluate(config, *TINY, "--model", "smollm2-135m")
    note = (f"evaluated for model smollm2-135m (--model), but {config} was tuned for llama-3-8b: its predicted "
            "figures (provenance) are that model's, and its byte sizes were chosen for it")
    assert _json(r)["model"] == "smollm2-135m" and _json(r)["notes"][0] == note
    assert f"note: {note}" in " ".join(r.stderr.split())


def test_a_recorded_model_that_is_no_preset_is_one_line_and_exit_2(tmp_path):
    r = _evaluate(_tuned_for(tmp_path, "gpt-9"), *TINY)
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'kv.yaml'}: tuned for model 'gpt-9' (its provenance), which is not a preset here "
        "(known: smollm2-135m, llama-3-8b, llama-3.1-70b, qwen2.5-7b, mistral-7b): give --model"]
    assert json.loads(r.stdout.strip().splitlines()[-1])["exit_code"] == 2


def test_a_lossy_config_shows_its_predicted_quality_loss(tmp_path):
    """evaluate had shown nothing of a tuned lossy config's quality (an H2O + int4 file): its predicted loss now,
    as the optimizer priced it (the shipped quality profile, budgets over the requests' p90 context)."""
    import numpy as np

    from skistune.config import load_config
    from skistune.quality import load_quality_profile
    from skistune.workloads import load_workload

    lossy = tmp_path / "lossy.yaml"
    lossy.write_text("bitwidth: {key_bits: 4, value_bits: 4}\neviction: {policy: h2o, budget_fraction: 0.5}\n")
    result = _evaluate(lossy, "--workload", "chat", "--requests", "20")
    quality = _json(result)["quality"]
    reqs = load_workload("chat", requests=20)
    context = int(np.percentile(reqs.input_tokens + reqs.output_tokens, 90))
    expected = load_quality_profile().predict(load_config(lossy), "smollm2-135m", context)
    assert quality["ppl_mean"] == pytest.approx(expected.ppl_mean) and quality["basis"] == "measured"
    assert quality["ppl_mean_bound"] == pytest.approx(expected.guarded_mean)
    assert "quality loss (predicted)" in result.stdout
    plain = tmp_path / "plain.yaml"
    plain.write_text("batching: {max_num_seqs: 64}\n")
    assert _json(_evaluate(plain, "--workload", "chat", "--requests", "20"))["quality"] is None
