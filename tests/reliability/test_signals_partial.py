"""What a stopped `skistune report` or `skistune quality` says it kept, at the moments a real signal rarely hits
(run in process, the stop raised where the signal would land): a report stopped between two of its files, one
stopped over an earlier report's files, a quality run stopped with a partial file (how many measurements it
keeps, the exact command that resumes it), and a signal once a command has finished (`skistune.cli.main`)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from reliability_helpers import create_study, subprocess_env
from typer.testing import CliRunner

import skistune.paths
from skistune.cli import app
from skistune.signals import Terminated

STOPS = [(KeyboardInterrupt, 130, "interrupted"), (Terminated, 143, "terminated")]


def last_json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def last_line(result) -> str:
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


# ---- report ----

@pytest.fixture(scope="module")
def study(tmp_path_factory, profile):
    url = f"sqlite:///{tmp_path_factory.mktemp('study') / 's.db'}"
    create_study(url, "s", profile, n_trials=3)
    return url


def stop_at_write(monkeypatch, n: int, stop: type) -> None:
    """The ``n``-th file written (`paths.write_atomic`, 1 first) raises ``stop`` instead."""
    real, calls = skistune.paths.write_atomic, []

    def write(path, text):
        calls.append(path)
        if len(calls) == n:
            raise stop()
        return real(path, text)

    monkeypatch.setattr(skistune.paths, "write_atomic", write)


@pytest.mark.parametrize("stop, code, stopped", STOPS)
def test_a_report_stopped_between_its_files_names_those_written(monkeypatch, tmp_path, study, stop, code, stopped):
    stop_at_write(monkeypatch, 2, stop)
    out = tmp_path / "r"
    r = CliRunner().invoke(app, ["report", "s", "--storage", study, "--out-dir", str(out), "--json"])
    assert r.exit_code == code, r.output
    rerun = f"skistune report s --storage {study} --out-dir {out}"
    assert last_line(r) == (f"{stopped}: wrote {out / 'pareto.png'} of the report, not latency-cdf.png, "
                            f"memory-timeline.png, report.html; rerun `{rerun}` to write it whole (it rewrites "
                            "every file)")
    assert last_json(r) == {"stopped": stopped, "exit_code": code, "study": "s", "storage": study,
                            "out_dir": str(out), "written": [str(out / "pareto.png")], "rerun": rerun}
    assert sorted(p.name for p in out.iterdir()) == ["pareto.png"]  # (whole: no temporary file)


def test_a_report_stopped_before_its_files_says_which_are_an_earlier_reports(monkeypatch, tmp_path, study):
    out = tmp_path / "r"
    out.mkdir()
    (out / "report.html").write_text("<html>an earlier report</html>")
    stop_at_write(monkeypatch, 1, KeyboardInterrupt)
    r = CliRunner().invoke(app, ["report", "s", "--storage", study, "--out-dir", str(out), "--top", "3"])
    assert r.exit_code == 130, r.output
    assert last_line(r) == (f"interrupted: no report file written ({out} keeps the report.html of an earlier "
                            f"report); rerun `skistune report s --storage {study} --out-dir {out} --top 3` to write "
                            "the report")
    assert (out / "report.html").read_text() == "<html>an earlier report</html>"
    assert "stopped" not in r.stdout  # (no --json: no JSON)


# ---- quality ----

def quick_total() -> int:
    from skistune.quality.grid import GRIDS
    from skistune.runtime.presets import get_preset

    grid = GRIDS["quick"]
    return len(grid.perplexity(get_preset("smollm2-135m").n_layers)) + len(grid.needle())


@pytest.fixture
def measuring(monkeypatch):
    """`skistune quality` with no model loaded and a measurement that writes ``taken[0]`` perplexity entries to its
    file (as the real one writes after each) and then raises ``stop[0]``."""
    import skistune.quality.measure as measure
    from skistune.quality.grid import GRIDS
    from skistune.runtime.llm import Runtime

    taken, stop = [0], [KeyboardInterrupt]

    def build_profile(runtime, grid, out, *, resume=True, progress=None, note=None):
        data = {"format": measure.FORMAT, "version": measure.VERSION, "model": "smollm2-135m", "n_layers": 30,
                "protocol": {"grid": grid.name}, "perplexity": {}, "needle": {}}
        for m in grid.perplexity(30)[:taken[0]]:
            data["perplexity"][measure.knob_key(m.knobs)] = {"kind": m.kind, "knobs": m.knobs}
            skistune.paths.write_atomic(out, json.dumps(data))
        raise stop[0]()

    assert GRIDS["quick"].name == "quick"
    monkeypatch.setattr(Runtime, "from_preset", classmethod(lambda cls, *a, **k: None))
    monkeypatch.setattr(measure, "build_profile", build_profile)
    return taken, stop


@pytest.mark.parametrize("stop, code, stopped", STOPS)
def test_a_stopped_quality_run_says_what_its_file_keeps_and_how_to_resume(measuring, tmp_path, stop, code, stopped):
    measuring[0][0], measuring[1][0] = 5, stop
    path = tmp_path / "q.json"
    r = CliRunner().invoke(app, ["quality", "--quick", "--out", str(path), "--json"])
    assert r.exit_code == code, r.output
    total, rerun = quick_total(), f"skistune quality --quick --out {path}"
    assert last_line(r) == f"{stopped}: {path} keeps 5 of {total} measurements; rerun `{rerun}` to resume"
    assert last_json(r) == {"stopped": stopped, "exit_code": code, "out": str(path), "kept": 5, "total": total,
                            "rerun": rerun}


def test_a_fresh_run_stopped_resumes_without_fresh_once_it_has_written(measuring, tmp_path):
    path = tmp_path / "q.json"
    path.write_text("{}")  # (what --fresh measures over)
    r = CliRunner().invoke(app, ["quality", "--quick", "--fresh", "--out", str(path)])
    assert r.exit_code == 130
    assert last_line(r) == (f"interrupted: no measurement taken yet: {path} is as it was (--fresh had not replaced "
                            f"it); rerun `skistune quality --quick --out {path} --fresh` to measure again")
    assert path.read_text() == "{}"
    measuring[0][0] = 3
    r = CliRunner().invoke(app, ["quality", "--quick", "--fresh", "--out", str(path)])
    assert last_line(r) == (f"interrupted: {path} keeps 3 of {quick_total()} measurements; rerun "
                            f"`skistune quality --quick --out {path}` to resume")  # (--fresh would start over)


def test_a_quality_run_stopped_before_its_first_measurement_writes_nothing(measuring, tmp_path):
    path = tmp_path / "q.json"
    r = CliRunner().invoke(app, ["quality", "--quick", "--out", str(path), "--json"])
    assert r.exit_code == 130
    assert last_line(r) == ("interrupted: no measurement taken yet, no file written; rerun "
                            f"`skistune quality --quick --out {path}` to start again")
    assert last_json(r)["out"] is None and not path.exists()


# ---- once a command has finished ----

FINISHED = """
import os, signal, sys, threading, time
from skistune.signals import finished_before_signals
if sys.argv[1] == "busy":  # (a non-daemon thread still running: exit waits for it, Ctrl-C must still stop it)
    threading.Thread(target=time.sleep, args=(2,)).start()
finished_before_signals()
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.3)
sys.exit(3)
"""


def test_a_signal_once_a_command_has_finished_leaves_its_exit_code():
    """The interpreter's teardown after a written report had ended killed by SIGINT (exit -2, no line)."""
    run = [sys.executable, "-c", textwrap.dedent(FINISHED)]
    done = subprocess.run([*run, "idle"], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert done.returncode == 3 and done.stderr == ""
    busy = subprocess.run([*run, "busy"], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert busy.returncode != 3 and "KeyboardInterrupt" in busy.stderr
