"""Ctrl-C and SIGTERM, as every command ends on them: one line on stderr saying what was kept and how to go on
(``interrupted: <what>`` or ``terminated: <what>``), exit code 130 (Ctrl-C) or 143 (SIGTERM: `timeout`, `docker
stop`), and with --json ``{"stopped": ..., "exit_code": ..., <the command's fields>}`` as stdout's last line (a
script reading it learns why there are no figures, and what is left).

    with stopped_by_signal(lambda: ("nothing written; rerun `skistune ...`", {"out": None}), json_out):
        ...the command's work...

``kept`` is called only when a signal stopped the work, so that it can look at what was written by then
(`file_states` before the work, `written_since` after). SIGTERM raises `Terminated` (a KeyboardInterrupt) in the
block (`sigterm_as_interrupt`: optimize's search and its workers stop on the same exception).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["Terminated", "interrupted_exit_code", "raise_terminated", "sigterm_as_interrupt", "stopped_by_signal", "stopped_line",
           "file_states", "written_since", "rerun_command", "finished_before_signals", "signals_ignored"]

Kept = Callable[[], tuple]  # () -> (the text, the JSON fields)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: a search stopped by it ends as one stopped by Ctrl-C (the running
    trial marked failed, the finished ones kept) instead of leaving its trial running."""


def raise_terminated(signum: int, frame: Any) -> None:
    """SIGTERM's handler where a command stops on it: raises `Terminated`."""
    raise Terminated


def interrupted_exit_code(exc: KeyboardInterrupt) -> int:
    """A command's exit code when a signal stopped it: 128 + the signal, as a shell reports a process the
    signal killed (130 for Ctrl-C, 143 for SIGTERM)."""
    return 143 if isinstance(exc, Terminated) else 130


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises `Terminated` (a KeyboardInterrupt) while the block runs; outside the main thread, where
    no handler can be set, it stays as it was."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped_line(exc: KeyboardInterrupt, kept: str) -> str:
    """``interrupted: <kept>`` (Ctrl-C) or ``terminated: <kept>`` (SIGTERM)."""
    return f"{'terminated' if isinstance(exc, Terminated) else 'interrupted'}: {kept}"


@contextlib.contextmanager
def stopped_by_signal(kept: Kept, json_out: bool) -> Iterator[None]:
    """Run the block with SIGTERM raising `Terminated`; Ctrl-C or SIGTERM in it ends the command with the line,
    the JSON (``json_out``) and the exit code of the module's docstring. ``kept()`` returns the line's text
    after ``interrupted: `` (what was kept, how to resume) and the JSON's fields after ``stopped`` and
    ``exit_code``. A second signal while they are printed is ignored: the line is not cut by a traceback."""
    import typer

    try:
        with sigterm_as_interrupt():
            yield
    except KeyboardInterrupt as exc:
        from rich.markup import escape

        from skistune.cli_base import err_console, print_json

        code = interrupted_exit_code(exc)
        with signals_ignored():
            try:
                text, fields = kept()
            except (OSError, ValueError, KeyError, TypeError) as error:  # (the line is printed whatever happens)
                text, fields = f"what was kept could not be read ({error})", {}
            err_console.print(escape(stopped_line(exc, text)), highlight=False, soft_wrap=True)
            if json_out:
                print_json({"stopped": "terminated" if isinstance(exc, Terminated) else "interrupted",
                            "exit_code": code, **fields})
        raise typer.Exit(code) from None


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored in the block (main thread only; restored after: tests run commands in
    process)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def file_states(paths: Iterable[Path]) -> dict[Path, Any]:
    """Each file's identity before a command writes (inode, change time, size; None: missing). A file written
    through `skistune.paths.write_atomic` is a new inode, so `written_since` tells it from an old one even
    within one clock tick."""
    return {Path(p): _state(Path(p)) for p in paths}


def written_since(before: dict[Path, Any]) -> list[Path]:
    """The files of ``before`` (`file_states`) written since, in its order."""
    return [p for p, state in before.items() if _state(p) is not None and _state(p) != state]


def _state(path: Path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def rerun_command(ctx: Any, drop: Iterable[str] = ()) -> str:
    """The command of click context ``ctx`` as it was given (``skistune report s --out-dir r``: its arguments,
    and the options given on the command line, not left at their defaults), quoted for a shell, without --json
    and the options in ``drop`` (quality's --fresh, which would not resume)."""
    from skistune.cli_base import _command_path

    dropped = {"--json", *drop}
    words = _command_path(ctx).split()
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        value = ctx.params.get(param.name)
        if param.param_type_name == "argument":
            words += [str(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]
            continue
        # (by name: typer may run a vendored click, whose ParameterSource is not the installed click's)
        if source is None or source.name in ("DEFAULT", "DEFAULT_MAP") or not param.opts:
            continue
        flag = param.opts[0]
        if flag in dropped:
            continue
        if getattr(param, "is_flag", False):
            words += [flag] if value else list(getattr(param, "secondary_opts", ())[:1])
        else:
            words += [w for v in (value if getattr(param, "multiple", False) else [value]) for w in (flag, str(v))]
    return shlex.join(words)


def finished_before_signals() -> None:
    """Once a command has finished (its files written, its output printed; `skistune.cli.main`): Ctrl-C and
    SIGTERM are ignored while the interpreter tears down, a second or two of freeing torch and plotting modules
    in which Python has put back the default actions: a Ctrl-C there had ended a whole, written report killed by
    SIGINT (exit -2, no line); the process now ends with the command's own exit code. (Ignored, not blocked:
    a blocked signal is delivered to the OpenMP threads, which do not block it, and raised in the main thread
    all the same; Python leaves an ignored one ignored to the end.) Not while a non-daemon thread still runs
    (exit waits for it, which Ctrl-C must still be able to stop), nor off the main thread."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
