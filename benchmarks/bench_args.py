"""Argument types shared by the benchmark scripts: each turns bad input into argparse's own error (a usage
line and ``error: ...`` on stderr, exit code 2) instead of a traceback later. Also what every script shares
around them: ``description`` and ``add_json`` for its parser, ``fail``, ``check_device`` and ``check_runtime``
for input found bad after parsing, ``console`` for its tables and ``print_json``, the one way a script prints
its ``--json`` figures. The scripts run as ``python benchmarks/NAME.py``, which puts this
folder first on ``sys.path``; so no script here may be named like an installed package or a standard-library
module (``kernels.py`` once shadowed Hugging Face's ``kernels``, which transformers imports). A script imports
this module before torch: it imports skistune, which sets OpenMP's wait policy before torch loads OpenMP (a
script that loaded torch first had replayed with spinning threads what the profile, measured by the command
line, timed with sleeping ones: x0.6 of the profile's decode steps on an Intel host)."""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, NoReturn

import skistune  # noqa: F401  (first: sets OpenMP's wait policy before torch loads; see above)

JSON_HELP = "end with the figures as one JSON object on the last line"
# a sentence ends at . ! or ? before a space or the end of its paragraph, not after an abbreviation
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)(?<!\betc)(?<!\bcf)[.!?](?=\s|$)")


def description(doc: str) -> str:
    """A script's ``--help`` description: the first sentence of its docstring, joined across lines (the first
    line alone stopped mid-sentence in most scripts). The sentence ends at its paragraph's end at the latest
    (a blank line, or the indented usage line)."""
    lines = []
    for line in doc.strip().splitlines():
        if not line.strip() or (lines and line[:1].isspace()):
            break
        lines.append(line.strip())
    paragraph = " ".join(lines)
    end = _SENTENCE_END.search(paragraph)
    return paragraph if end is None else paragraph[:end.end()]


def add_json(parser: argparse.ArgumentParser) -> None:
    """The ``--json`` option, with the same help in every script."""
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def print_json(figures: dict) -> None:
    """A script's ``--json`` figures: one strict JSON object on the last line of stdout, through the CLI's own
    ``skistune.cli.print_json`` (an infinite or undefined figure is null: JSON has no NaN or Infinity)."""
    from skistune.cli import print_json as strict

    strict(figures)


def fail(message: str) -> NoReturn:
    """Bad input found after parsing: one ``error:`` line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_runtime(model: str, device: str) -> None:
    """Before a script builds the runtime: a model the device here cannot hold (or no such device) is one
    ``error:`` line and exit code 2, not the kernel's out-of-memory kill."""
    from skistune.evaluate import runtime_unavailable

    reason = runtime_unavailable(model, device)
    if reason is not None:
        fail(f"--model {model} --device {device}: {reason}")


def check_device(device: str) -> None:
    """``--device cuda`` on a machine without one (or a torch built without CUDA): one ``error:`` line, exit
    code 2, before any tensor is made there (torch's own answer is an AssertionError's traceback)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device here")


def console(stderr: bool = False):
    """A rich Console for a script's tables: a terminal's own width, but 200 columns (the CLI's
    ``skistune.cli.PIPED_WIDTH``) when written to a pipe or a file, where rich's default of 80 wraps a table's
    rows mid-row; ``COLUMNS`` still decides where it is set."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if "COLUMNS" in os.environ or stream.isatty():
        return Console(stderr=stderr)
    from skistune.cli import PIPED_WIDTH

    return Console(stderr=stderr, width=PIPED_WIDTH)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r}: must be {low} or more")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number, 0 or more")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = nonnegative_float(text)
    except argparse.ArgumentTypeError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number above 0")
    return value


def existing_file(text: str) -> str:
    """The path of a file that exists (returned as given)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def existing_dir(text: str) -> str:
    """The path of a folder that exists (returned as given)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such folder")
    return text


def writable_dir(text: str) -> str:
    """A folder to write into: one that exists, or a path where one can be made (returned as given). Checked
    when parsing: a file in its place was found only when the first result was saved, after the work."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a folder")
    parent = path
    while not parent.exists():  # the nearest part of the path that exists: the folder is made under it
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not writable")
    return text


def nonempty(text: str) -> str:
    """A string with something in it (an empty one had silently meant the option was not given)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: empty")
    return text


def name_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """A type for a comma-separated list of names, each one of ``choices`` (empty items are skipped; a list
    that names nothing is refused: taken as no option at all, it had meant every name)."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r} names nothing (choose from {', '.join(allowed)})")
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))} "
                                             f"(choose from {', '.join(allowed)})")
        return names

    return parse


def slo_text(text: str) -> str:
    """An SLO as ``skistune optimize --slo`` takes it (e.g. ``p99=200ms``), checked by its parser; returned as given."""
    from skistune.slo import parse_slo

    try:
        parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def hardware_profile(text: str) -> str:
    """A hardware profile that loads: ``skistune profile``'s JSON, or a shipped profile by name
    (``cpu-smollm2-135m``, as the commands take it); returned as the file's path."""
    from skistune.profile import load_profile
    from skistune.profile.profile import profile_path

    try:
        path = str(profile_path(text))
    except ValueError as exc:  # (a bare name that is neither a file nor a shipped profile)
        raise argparse.ArgumentTypeError(str(exc)) from None
    existing_file(path)
    try:
        load_profile(path, check_fingerprint=False)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def quality_profile(text: str) -> str:
    """The path of a quality profile (``skistune quality``'s JSON) that loads; returned as given."""
    from skistune.quality import load_quality_profile

    existing_file(text)
    try:
        load_quality_profile(text)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
