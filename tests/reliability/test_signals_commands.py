"""Ctrl-C and SIGTERM on `skistune report` and `skistune profile`, as real processes: each had exited 130 printing
nothing on Ctrl-C, and been killed by SIGTERM (exit -15, no line, no JSON). Now, as optimize and evaluate: one
line on stderr saying what was kept and the command to rerun, exit 130 (Ctrl-C, sent to the process group as a
terminal does) or 143 (SIGTERM to the process), ``{"stopped": ...}`` as --json's last line, no partial file."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from reliability_helpers import PROFILE, create_study, skistune_cmd, subprocess_env


def stop(args: list[str], sig: signal.Signals, cwd, *, after_line: str | None = None, after_s: float = 0.0):
    """Run ``skistune ARGS`` in its own session, send ``sig`` once a stdout line containing ``after_line`` is
    out (any line: "") or ``after_s`` seconds after the start, and return (exit code, stdout, stderr). SIGINT
    goes to the process group (Ctrl-C), SIGTERM to the process (`kill`, `timeout`)."""
    # (unbuffered, read a byte at a time: a buffered read of the marker's line had taken the lines after it, which
    # `communicate` then did not see)
    p = subprocess.Popen(skistune_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                         env=subprocess_env(), cwd=cwd, start_new_session=True)
    seen = []
    try:
        if after_line is not None:
            for line in iter(p.stdout.readline, b""):
                seen.append(line)
                if after_line.encode() in line:
                    break
        else:
            time.sleep(after_s)
        assert p.poll() is None, f"ended before the signal: {p.returncode}"
        os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, b"".join([*seen, out]).decode(), err.decode()


def assert_one_line(err: str, stopped: str) -> str:
    """The last stderr line says why it stopped; no traceback anywhere."""
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{stopped}: "), err
    return last


def no_temporary_files(folder) -> bool:
    return not [p for p in os.listdir(folder) if p.endswith(".tmp")]


# ---- report ----

@pytest.fixture(scope="module")
def study(tmp_path_factory, profile):
    folder = tmp_path_factory.mktemp("study")
    url = f"sqlite:///{folder / 's.db'}"
    create_study(url, "s", profile, n_trials=3)
    return url


@pytest.mark.parametrize("sig, code, stopped", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "terminated")])
def test_a_stopped_report_says_nothing_was_written_and_how_to_write_it(study, tmp_path, sig, code, stopped):
    """Stopped while it simulates and draws (its tables are out): no report file, no folder left behind."""
    args = ["report", "s", "--storage", study, "--out-dir", "r", "--json"]
    rc, out, err = stop(args, sig, tmp_path, after_line="")
    assert rc == code, err
    line = assert_one_line(err, stopped)
    rerun = f"skistune report s --storage {study} --out-dir r"
    assert line == f"{stopped}: no report file written; rerun `{rerun}` to write the report"
    assert json.loads(out.strip().splitlines()[-1]) == {
        "stopped": stopped, "exit_code": code, "study": "s", "storage": study, "out_dir": "r", "written": [],
        "rerun": rerun}
    assert not (tmp_path / "r").exists() and no_temporary_files(tmp_path)


def test_a_signal_once_the_report_is_written_changes_nothing(study, tmp_path):
    """Ctrl-C just after "wrote ...": the interpreter's teardown (a second or more) had been killed by SIGINT
    (exit -2, no line) after the whole report was written. Now it ends with its own code, or, caught before the
    command returned, 130 saying the report was written whole."""
    rc, out, err = stop(["report", "s", "--storage", study, "--out-dir", "r", "--json"], signal.SIGINT, tmp_path,
                        after_line="wrote ")
    assert rc in (0, 130), (rc, err)
    assert "Traceback" not in err
    last = json.loads(out.strip().splitlines()[-1])
    if rc == 0:
        assert last["files"]["html"] == "r/report.html"
    else:
        assert last["stopped"] == "interrupted" and len(last["written"]) >= 1
        assert "the report was written whole" in err
    assert (tmp_path / "r" / "report.html").read_text().rstrip().endswith("</html>")


# ---- profile ----

@pytest.mark.parametrize("sig, code, stopped, json_out", [(signal.SIGINT, 130, "interrupted", False),
                                                          (signal.SIGTERM, 143, "terminated", True)])
def test_a_stopped_profile_writes_nothing_and_says_so(tmp_path, sig, code, stopped, json_out):
    """Stopped while it loads the model or measures (a quick profile takes up to a minute): a profile is written
    whole at the end, so no file, no temporary file."""
    args = ["profile", "--quick", "--out", "p.json"] + (["--json"] if json_out else [])
    rc, out, err = stop(args, sig, tmp_path, after_s=4.0)
    assert rc == code, err
    line = assert_one_line(err, stopped)
    rerun = "skistune profile --quick --out p.json"
    assert line == (f"{stopped}: no profile written: a profile is written whole at the end of the measurement, "
                    f"nothing part way; rerun `{rerun}` to measure again")
    if json_out:
        assert json.loads(out.strip().splitlines()[-1]) == {"stopped": stopped, "exit_code": code, "out": None,
                                                            "rerun": rerun}
    else:
        assert "stopped" not in out
    assert not (tmp_path / "p.json").exists() and no_temporary_files(tmp_path)


def test_a_stopped_profile_check_writes_nothing(tmp_path):
    """--check times the profile's steps again and writes nothing: stopped, it says so."""
    rc, out, err = stop(["profile", "--check", str(PROFILE), "--json"], signal.SIGTERM, tmp_path, after_s=3.0)
    assert rc == 143, err
    line = assert_one_line(err, "terminated")
    assert line == (f"terminated: nothing written (--check only times the profile's steps again); rerun "
                    f"`skistune profile --check {PROFILE}` to run it again")
    assert json.loads(out.strip().splitlines()[-1])["out"] is None


# ---- worker ----

def test_a_stopped_worker_names_its_study_and_the_command_that_adds_more(study, tmp_path):
    """A worker stopped mid-search had said only "finished trials are kept in the study": now, as optimize's
    search, the study, the trials this worker added and the command that adds more."""
    import optuna

    def trials():
        return len(optuna.load_study(study_name="s", storage=study).get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))

    before = trials()
    p = subprocess.Popen(skistune_cmd("worker", "s", "--storage", study, "--trials", "300"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=subprocess_env(), cwd=tmp_path, start_new_session=True)
    try:
        give_up = time.monotonic() + 120
        while trials() == before and p.poll() is None and time.monotonic() < give_up:  # (its first trial stored)
            time.sleep(0.1)
        assert p.poll() is None, p.communicate()[1].decode()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 143, err.decode()
    line = assert_one_line(err.decode(), "terminated")
    assert re.fullmatch(rf"terminated: study s keeps its finished trials \(\d+ from this worker\); rerun "
                        rf"`skistune worker s --storage {re.escape(study)} --trials 300` to add more", line), line
