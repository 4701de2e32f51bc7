"""The `skistune` program: its console script and ``python -m skistune`` start here, not in `skistune.cli`.

Loading the command line (typer, rich, numpy, Optuna, the command modules) takes 0.3 s on a quiet machine and
more on a slow one; a Ctrl-C or SIGTERM in that time had printed a KeyboardInterrupt traceback (exit -2) or
killed the process (exit -15). Here both are handled before that import starts: the program ends as a stopped
command does (`skistune.signals`): one line on stderr, ``interrupted: ...`` or ``terminated: ...``, exit 130
(Ctrl-C) or 143 (SIGTERM), and with --json ``{"stopped": ..., "exit_code": ...}`` as stdout's last line.

So this module imports only the standard library and `skistune.signals` (which imports nothing heavier) before
`skistune.cli`; ``import skistune`` itself is light (its public API loads on first use).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

# tests only (tests/test_entry_signals.py): once the handlers below are set, write STARTUP_MARK on stderr and
# wait this many seconds before loading the command line, so that a test can stop the program at a moment it
# knows to be inside start-up, whatever the speed of the machine
TEST_DELAY_ENV = "SKISTUNE_TEST_STARTUP_DELAY_S"
STARTUP_MARK = "skistune: starting\n"


def main() -> None:
    try:
        from skistune.signals import interrupted_exit_code, raise_terminated

        # SIGTERM raises `Terminated` (a KeyboardInterrupt) from now to the end, as the long commands set it for
        # their work: the command line maps one that no command handled to exit 143 (`cli._one_line_errors`). A
        # SIGTERM the parent process set to be ignored stays ignored. (Python's Ctrl-C handler is set already.)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, raise_terminated)
        _signals_in_callbacks_raised_again()
        _test_delay()
        _drop_unusable_width()
        from skistune.cli import main as cli_main
    except KeyboardInterrupt as exc:
        _stopped_while_starting(exc)
    try:
        cli_main()
    except SystemExit:  # (every command ends so, stopped by a signal or not)
        _forget_caught_interrupt()
        raise
    except KeyboardInterrupt as exc:
        # one that came past typer's handling as the command ended, before `cli.main` ignored signals: the
        # command's output is out, so nothing more is said than the exit code
        _ignore_signals()
        _forget_caught_interrupt()
        raise SystemExit(interrupted_exit_code(exc)) from None


def _signals_in_callbacks_raised_again() -> None:
    """A signal whose handler raised inside a callback that cannot raise (a weak reference's, a ``__del__``: the
    import system's module locks have one) is sent again, so that it stops the program where it can, and nothing
    is printed. CPython had written "Exception ignored in ... Traceback ... Terminated" and gone on as if no
    signal had come (a SIGTERM 0.1 s into `python -m skistune --help`, once in a CI run). Other exceptions such a
    callback raises are reported as before."""
    import _thread

    from skistune.signals import Terminated

    report = sys.unraisablehook

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            report(unraisable)
            return
        signum = signal.SIGTERM if isinstance(unraisable.exc_value, Terminated) else signal.SIGINT
        # From a new thread, which runs once the main thread lets go of the interpreter, out of the callback by
        # then: marked pending from here (`_thread.interrupt_main`, `signal.raise_signal`, `os.kill`), the handler
        # runs at once, in this hook, and its exception is lost again; so would it in `threading.Thread.start`,
        # which waits for the thread. One that lands in another such callback is sent again.
        try:
            _thread.start_new_thread(_thread.interrupt_main, (signum,))
        except RuntimeError:  # (no new thread while the interpreter shuts down: it ends anyway)
            pass

    sys.unraisablehook = hook


def _drop_unusable_width() -> None:
    """COLUMNS that is not a positive whole number is dropped before the consoles are made (they read it then):
    COLUMNS=0 had printed nothing at all, errors included."""
    columns = os.environ.get("COLUMNS")
    if columns is not None and not (columns.strip().isdigit() and int(columns) > 0):
        del os.environ["COLUMNS"]


def _ignore_signals() -> None:
    """Ctrl-C and SIGTERM ignored to the end: a second one while the program ends would print a traceback
    (as `signals.signals_ignored`; the process ends just after, so they are not put back)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def _forget_caught_interrupt() -> None:
    """Keep the exit code the program chose. CPython notes a KeyboardInterrupt that ends code run from a string
    (``exec(str)``: dataclasses and namedtuple build their methods so, at import) even when a caller catches it,
    and under ``python -m`` then ends the process with SIGINT whatever its exit code (-2, not 130: a Ctrl-C in
    a dataclass's creation, about one stop in three while `skistune.cli` loads). The next string exec clears the note
    (CPython's `run_eval_code_obj`; the console script runs as a file, which does not check it)."""
    exec("None", {})


def _test_delay() -> None:
    delay = os.environ.get(TEST_DELAY_ENV)
    if delay is not None:
        import time

        sys.stderr.write(STARTUP_MARK)
        sys.stderr.flush()
        # (the wait runs from a string, as dataclasses build their methods at import: a stop there is the one
        # that CPython ends with SIGINT under `python -m`, which `_forget_caught_interrupt` undoes)
        exec(f"sleep({float(delay)!r})", {"sleep": time.sleep})


def _stopped_while_starting(exc: KeyboardInterrupt) -> NoReturn:
    """End the program stopped by ``exc`` before any command ran: the line, the JSON with --json, the code."""
    _ignore_signals()  # (a second signal would cut the line with a traceback)
    from skistune.signals import Terminated, interrupted_exit_code, stopped_line

    code = interrupted_exit_code(exc)
    # (plain writes, not rich: the import that would load it is what was stopped)
    sys.stderr.write(stopped_line(exc, "skistune was starting; no command ran, nothing was done") + "\n")
    if "--json" in sys.argv[1:]:
        import json

        stopped = "terminated" if isinstance(exc, Terminated) else "interrupted"
        sys.stdout.write(json.dumps({"stopped": stopped, "exit_code": code}, separators=(",", ":")) + "\n")
    _forget_caught_interrupt()
    raise SystemExit(code)
