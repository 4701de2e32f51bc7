"""Ctrl-C and SIGTERM while `skistune` starts (`skistune.entry`), as real processes. Loading the command line takes
0.3 s and more; a Ctrl-C in it had printed a KeyboardInterrupt traceback (exit -2) and a SIGTERM killed the
process (exit -15). Now: ``interrupted: ...`` / ``terminated: ...`` as the one line on stderr, exit 130 / 143, and
with --json ``{"stopped": ..., "exit_code": ...}`` on stdout, as every command stopped by a signal.

The signal is sent once the child says its handlers are set (`entry.STARTUP_MARK`, written when the test
variable is set): before that, Python itself is starting (its `site` took 0.2 s on a loaded 2-core machine),
where no program's code runs. The deterministic tests also hold the child inside start-up (a long test delay),
so that a slow machine cannot make the signal come after start-up and pass for the wrong reason."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from skistune.entry import STARTUP_MARK, TEST_DELAY_ENV
from skistune.signals import Terminated

SIGNALS = [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
STARTING = "skistune was starting; no command ran, nothing was done"
HOLD_S = 60.0  # the test delay that holds the child in start-up: far longer than any signal takes to stop it
CONSOLE_SCRIPT = Path(sys.executable).with_name("skistune")  # (`pip install -e .` put it beside the interpreter)
LAUNCHERS = {"python -m skistune": [sys.executable, "-m", "skistune"], "console script": [str(CONSOLE_SCRIPT)]}


def start(launcher: str, args: list[str], delay_s: float, cwd) -> subprocess.Popen:
    """The program in its own session (a Ctrl-C goes to its process group, as a terminal sends it), started with
    the test delay; returns once it has written `STARTUP_MARK` (its handlers are set)."""
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", TEST_DELAY_ENV: str(delay_s)}
    p = subprocess.Popen([*LAUNCHERS[launcher], *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                         env=env, cwd=cwd, start_new_session=True)
    # (a child that never writes the mark is killed, so that the read below ends instead of hanging the run)
    watchdog = threading.Timer(120, p.kill)
    watchdog.start()
    try:
        first = p.stderr.readline().decode()
    finally:
        watchdog.cancel()
    assert first == STARTUP_MARK, (first, p.communicate())
    return p


def send(p: subprocess.Popen, sig: signal.Signals) -> tuple[int, str, str]:
    """Ctrl-C to the process group, SIGTERM to the process (`kill`, `timeout`); (exit code, stdout, stderr)."""
    os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)
    try:
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, out.decode(), err.decode()


def test_the_console_script_starts_at_the_light_entry():
    """An install made before `skistune.entry` existed runs `skistune.cli:main`: the script is reinstalled."""
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "skistune"]
    assert script.value == "skistune.entry:main"
    assert CONSOLE_SCRIPT.exists()


def test_the_entry_loads_nothing_heavy_before_its_handlers():
    """What `skistune.entry` imports runs before any handler is set: only the standard library and skistune's
    light modules (the package's API loads on first use)."""
    code = ("import sys, skistune.entry; print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('typer', 'click', 'rich', 'numpy', 'optuna', 'torch', 'scipy', 'yaml') or m == 'skistune.cli')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == ""


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("sig, code, stopped", SIGNALS)
def test_a_signal_while_starting_ends_with_one_line_and_its_code(tmp_path, launcher, sig, code, stopped):
    """Held in start-up: the stop is always start-up's. Under ``python -m`` the wait runs from a string, where
    CPython had ended the process with SIGINT (-2) whatever its exit code (`entry._forget_caught_interrupt`)."""
    p = start(launcher, ["optimize", "--requests", "8"], HOLD_S, tmp_path)
    time.sleep(0.1)
    sent = time.monotonic()
    rc, out, err = send(p, sig)
    assert time.monotonic() - sent < HOLD_S / 2  # (it stopped on the signal, not at the end of the delay)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert rc == code, err
    assert err.splitlines()[-1] == f"{stopped}: {STARTING}"
    assert out == ""  # (no --json: stdout stays empty)
    assert not list(tmp_path.iterdir())  # (optimize did not start: nothing written)


@pytest.mark.parametrize("sig, code, stopped", SIGNALS)
def test_with_json_a_signal_while_starting_ends_stdout_with_the_stop(tmp_path, sig, code, stopped):
    p = start("python -m skistune", ["evaluate", "--json"], HOLD_S, tmp_path)
    rc, out, err = send(p, sig)
    assert rc == code, err
    assert json.loads(out.strip().splitlines()[-1]) == {"stopped": stopped, "exit_code": code}


CALLBACK_STOP = """
import signal, sys, time
from skistune.entry import _signals_in_callbacks_raised_again
from skistune.signals import Terminated, raise_terminated

signal.signal(signal.SIGTERM, raise_terminated)
_signals_in_callbacks_raised_again()

class Stopped:
    def __del__(self):  # (a signal's handler that raised here: CPython can only report it)
        raise {exc}

class Failing:
    def __del__(self):
        raise ValueError("a callback's own error")

try:
    Failing()
    Stopped()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # (the signal sent again lands here, out of the callback)
        pass
    print("went on")
except KeyboardInterrupt as exc:
    print(type(exc).__name__)
"""


@pytest.mark.parametrize("exc", ["Terminated", "KeyboardInterrupt"])
def test_a_signal_raised_in_a_callback_that_cannot_raise_is_sent_again_and_stops_the_program(exc):
    """A SIGTERM 0.1 s into `python -m skistune --help` had landed in a module lock's weak-reference callback
    during the import: "Exception ignored in ... Traceback ... Terminated" on stderr, and the program went on."""
    r = subprocess.run([sys.executable, "-c", CALLBACK_STOP.format(exc=exc)], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.strip() == exc
    assert "ValueError: a callback's own error" in r.stderr  # (other errors are reported as before)
    assert "Terminated" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr


@pytest.mark.parametrize("after_s", [0.1, 0.3])
@pytest.mark.parametrize("sig, code, stopped", SIGNALS)
def test_a_signal_during_the_real_start_up_never_prints_a_traceback(tmp_path, sig, code, stopped, after_s):
    """No delay: the signal lands where it lands (in the import of the command line, 0.3 s here and more on a
    slow machine, or in the help's printing, or after it), and the program ends quietly in each case: the stop's
    code (with start-up's line if it came in the import), or 0 with the whole help if it had finished."""
    p = start("python -m skistune", ["--help"], 0, tmp_path)
    time.sleep(after_s)
    rc, out, err = send(p, sig)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert rc in (code, 0), (rc, err)
    if rc == 0:
        assert "optimize" in out and err == ""
    elif err:
        assert err.splitlines()[-1] == f"{stopped}: {STARTING}"


@pytest.mark.parametrize("stop, code", [(KeyboardInterrupt, 130), (Terminated, 143)])
def test_a_stop_no_command_handled_ends_with_its_own_code(monkeypatch, stop, code):
    """`skistune.entry` keeps SIGTERM raising `Terminated` while commands run; in a command with no handler of its
    own (`workload show`), typer had ended it with Ctrl-C's 130."""
    from typer.testing import CliRunner

    from skistune.cli import app
    from skistune.workloads import cli as workload_cli

    def stopped(*args, **kwargs):
        raise stop

    monkeypatch.setattr(workload_cli, "load_workload", stopped)
    r = CliRunner().invoke(app, ["workload", "show", "chat"])
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
