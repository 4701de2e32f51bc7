"""`skistune.optimize(...)` refuses an argument of the wrong type or range with a ValueError that names it, before any
work (no study file created), as the CLI refuses its options. A tester's findings: ``seed=-1`` was accepted
(--seed refuses it), and ``seed=1.5``/``"x"``/``None``, ``timeout="5"``, ``max_queue_s="5s"``, ``storage=5``,
``quality=1``, ``space={...}`` and ``profile=5`` failed deep inside with numpy's, a comparison's, an attribute's or
a path's error that did not name the argument."""
from __future__ import annotations

import optuna
import pytest

import skistune
import skistune.optimize as opt


@pytest.mark.parametrize("argument, value", [
    ("seed", -1), ("seed", 1.5), ("seed", "x"), ("seed", None), ("seed", True),
    ("timeout", "5"), ("timeout", True), ("timeout", 0),
    ("max_queue_s", "5s"),
    ("storage", 5), ("storage", object()),
    ("quality", 1), ("quality", {"ppl": 0.01}), ("quality", [1]),
    ("space", {"params": {}}), ("space", 5),
    ("profile", 5), ("profile", ["profiles/cpu-smollm2-135m.json"]),
    ("quality_profile", 5),
])
def test_a_bad_argument_is_refused_by_name_before_any_work(here, profile, argument, value):
    arguments = {"slo": "p99=200ms", "profile": profile, "n_trials": 1, "validate": 0, argument: value}
    with pytest.raises(ValueError) as raised:
        skistune.optimize("chat", **arguments)
    assert str(raised.value).startswith(f"{argument}: {value!r} must be"), raised.value
    assert not list(here.iterdir())  # (no study file: refused before the storage was opened)


def test_solve_checks_its_own_arguments(here, profile):
    problem = opt.build_problem("chat", slo="p99=200ms", profile=profile)
    for argument, value in (("seed", -1), ("storage", 5), ("timeout", "5")):
        with pytest.raises(ValueError, match=f"^{argument}: "):
            opt.solve(problem, n_trials=1, validate=0, **{argument: value})
    assert not list(here.iterdir())


def test_good_arguments_of_every_accepted_kind_still_run(here, profile):
    """The checks refuse no kind the API documents: an int timeout, a storage object, a floor list, a seed of 0."""
    result = skistune.optimize("chat", slo="p99=200ms", profile=profile, n_trials=1, validate=0, seed=0, timeout=600,
                               max_queue_s=5, storage=optuna.storages.InMemoryStorage(), quality=[], space="default")
    assert len(result.study.trials) >= 1


# ---- the command's --out: an existing file that cannot be replaced is refused before the search ----
def _run_cli(*args):
    from pathlib import Path

    from typer.testing import CliRunner

    from skistune.cli import app

    shipped = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")
    return CliRunner().invoke(app, ["optimize", "--slo", "p99=200ms", "--requests", "16", "--trials", "2",
                                    "--validate", "0", "--profile", shipped, "--study", "o", *args])


@pytest.mark.parametrize("flag, what", [("+i", "immutable"), ("+a", "append-only")])
def test_an_out_file_marked_immutable_is_refused_before_the_search(here, monkeypatch, flag, what):
    """chattr +i (or +a) on an existing --out: the rename that writes it fails even as root; it had been found
    after the whole search, as "[Errno 1] cannot write ...". Now one line, before the study exists, file unchanged.
    Where chattr cannot set the flag (a file system or user without it), the kernel's answer is given instead."""
    import fcntl
    import shutil
    import struct
    import subprocess

    out = here / "ro.yaml"
    out.write_text("kept: 1\n")
    real = shutil.which("chattr") is not None and not subprocess.run(["chattr", flag, str(out)],
                                                                     capture_output=True).returncode
    if not real:
        bits = {"+i": 0x10, "+a": 0x20}[flag]  # FS_IMMUTABLE_FL, FS_APPEND_FL (linux/fs.h)
        monkeypatch.setattr(fcntl, "ioctl", lambda fd, request, arg: struct.pack("i", bits) + bytes(4))
    try:
        r = _run_cli("--out", "ro.yaml")
        assert r.exit_code == 2, r.output
        assert r.stderr.strip() == (f"error: --out ro.yaml: the existing file is {what} (chattr {flag}), so it cannot "
                                    f"be replaced: give another file, or lift the flag (chattr -{flag[1]} ro.yaml, "
                                    "as root)")
        assert not (here / "skistune-o.db").exists() and out.read_text() == "kept: 1\n"
    finally:
        if real:
            subprocess.run(["chattr", "-" + flag[1], str(out)], check=True)


def test_an_out_file_that_fails_after_the_search_says_so_without_an_errno_prefix(here, monkeypatch):
    """A write that fails anyway after the search (a disk gone read-only meanwhile): the line says what failed and
    that the study keeps its trials, not "[Errno 30] ..."."""
    def fail(self, path):
        raise OSError(30, f"cannot write {path}: Read-only file system")

    monkeypatch.setattr(opt.OptimizeResult, "write", fail)
    r = _run_cli("--out", "t.yaml")
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot write t.yaml: Read-only file system; the study o in "), line
    assert "keeps its trials" in line and "[Errno" not in line
