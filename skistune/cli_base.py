"""What every `skistune` command shares: the consoles, the one-line errors (``cli_errors``, click's usage
errors), ``--json`` and the root `app` the commands register on. It imports no command, so that each command's
module can import it first, whichever module is imported first (`skistune.cli` imports the commands to
assemble the program and re-exports these names).

Domain errors (``ValueError``, ``OSError``) are caught at this edge and printed as one line with exit
code 2, and so are click's own usage errors (unknown option, missing or bad value): ``error: <what>
(see skistune <command> --help)``. Commands that print figures take ``--json`` and then end with one JSON
object on the last line; on such an error too: ``{"error": <the line>, "exit_code": 2}``.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Callable

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from skistune.signals import Terminated

# emoji=False: user text (a trace's first line 'a:b:c', a path) is printed as it is; escape() leaves rich's
# :name: emoji codes alone, and 'a:b:c' had printed as 'a🅱c'
console = Console(emoji=False, soft_wrap=True)  # (a line of text stays one line: logs are grepped)
err_console = Console(stderr=True, emoji=False, soft_wrap=True)

EXIT_BAD_INPUT = 2

# every command's --json (its parameter is json_out: `cli_errors` reads it to end a refusal with JSON too)
JsonOpt = Annotated[bool, typer.Option("--json", help="end with one JSON object on the last line")]


def print_error(message: str) -> None:
    """``error: <message>`` as one line on stderr (the message is text, never rich markup)."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def print_warning(message: str) -> None:
    """``warning: <message>`` as one line on stderr."""
    err_console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _show_warning(message: Warning | str, category: type, filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    print_warning(str(message).strip())


def cli_errors(fn: Callable) -> Callable:
    """Turn domain errors into one line on stderr and exit code 2 (no traceback), and Python warnings (a
    profile measured on another machine, a library's deprecation) into one ``warning:`` line each instead of
    the interpreter's two lines naming a source file."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _show_warning
                return fn(*args, **kwargs)
        except (ValueError, OSError, KeyError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if isinstance(exc, KeyError):  # (a bare key, "error: 'bitwidth.key_bits'", said nothing of what lacked it)
                message = f"an entry {message} is missing (a file the command read lacks it)"
            print_error(message)
            if kwargs.get("json_out"):  # (every command's --json; a script reading the last line learns why)
                print_json({"error": message, "exit_code": EXIT_BAD_INPUT})
            raise typer.Exit(EXIT_BAD_INPUT) from None

    return wrapper


# click's error base class, whether typer uses the installed click or (typer >= 0.2x) a vendored copy
CLICK_EXCEPTION = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _command_path(ctx: Any) -> str:
    """``skistune`` and the subcommands of ``ctx`` (whatever the program was called)."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["skistune", *reversed(names)])


def usage_error_line(exc: Exception, command: str = "skistune") -> str:
    """click's error as one line, with the command whose help to read (the error's own context's when it
    has one, else ``command``)."""
    message = " ".join(line.strip() for line in exc.format_message().splitlines() if line.strip())
    ctx = getattr(exc, "ctx", None)
    return f"{message} (see {_command_path(ctx) if ctx is not None else command} --help)"


class OneLineErrors(TyperGroup):
    """The root command: click's usage errors (those of every subcommand too: they are parsed inside the
    root's ``invoke``) become one line on stderr, ``error: <message> (see skistune <cmd> --help)``, with
    click's exit code (2), instead of the boxed usage panel. Help, ``no_args_is_help``, ``typer.Exit``
    codes and Ctrl-C are untouched; a SIGTERM that no command handled ends with 143."""

    def make_context(self, info_name: Any, args: list[str], *rest: Any, **kwargs: Any) -> Any:
        with _one_line_errors("skistune", "--json" in args):
            return super().make_context(info_name, args, *rest, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        # an option's parse errors carry no context: name the command that the arguments lead to
        args = [*getattr(ctx, "_protected_args", ()), *ctx.args]
        with _one_line_errors(" ".join(["skistune", *self._subcommands(ctx, args)]), "--json" in args):
            return super().invoke(ctx)

    def _subcommands(self, ctx: Any, args: list[str]) -> list[str]:
        """The leading ``args`` that name a subcommand, a subcommand of that, ..."""
        names, command = [], self
        for name in args:
            sub = command.get_command(ctx, name) if hasattr(command, "get_command") else None
            if sub is None:
                break
            names.append(name)
            command = sub
        return names


@contextlib.contextmanager
def _one_line_errors(command: str, json_out: bool = False) -> Iterator[None]:
    """Print click's error (not the help that ``no_args_is_help`` raises) as one line; exit with its code. With
    ``--json`` among the arguments, the error is also the JSON object on stdout's last line."""
    try:
        yield
    except Terminated:
        # SIGTERM where no command handled it (arguments parsed, help printed, a command's own start): typer
        # ends a KeyboardInterrupt with 130, Ctrl-C's code; SIGTERM's is 143 (`skistune.entry` sets the handler)
        raise typer.Exit(143) from None
    except CLICK_EXCEPTION as exc:
        if "NoArgsIsHelpError" in {c.__name__ for c in type(exc).__mro__}:
            raise
        line = usage_error_line(exc, command)
        print_error(line)
        if json_out:
            print_json({"error": line, "exit_code": exc.exit_code})
        raise typer.Exit(exc.exit_code) from None


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, cls=OneLineErrors,
                  rich_markup_mode="markdown",
                  help="Find the best KV-cache settings for serving an LLM under latency, energy and "
                       "quality constraints.")


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("skistune")
        except PackageNotFoundError:  # (run from a checkout that was never installed)
            installed = "(not installed)"
        typer.echo(f"skistune {installed}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="print skistune's version and exit")] = False) -> None:
    """The program's own options, before any command (its help text is the app's)."""


def print_json(figures: dict) -> None:
    """The machine-readable result: one JSON object on the last line of stdout, strict JSON (an infinite
    or undefined figure, such as a gain over a baseline that meets no rate, is null: JSON has no Infinity)."""
    sys.stdout.write(json.dumps(json_ready(figures), separators=(",", ":"), default=float, allow_nan=False) + "\n")


def json_ready(value):
    """``value`` with every infinite or undefined float as None and numpy scalars as floats: what strict JSON
    can hold (commands and benchmarks print their figures through it)."""
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if not isinstance(value, (str, int, float, bool, type(None))) and hasattr(value, "__float__"):
        return json_ready(float(value))  # numpy scalars, as `default=float` did
    return value
