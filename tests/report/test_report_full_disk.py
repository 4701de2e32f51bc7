"""`skistune report` on a full disk: a plot had been left 0-byte or truncated (written with `Path.write_bytes`) and
the error named no file. Every file is now written whole or not at all (`paths.write_atomic`), and the command
ends with one line naming the file and the OS error (exit 2). The report's data and plots are stubbed: what is
tested is the writing, with ENOSPC injected part way through one plot's bytes."""
from __future__ import annotations

import errno
import json
import os
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from skistune.cli import app  # (first: it imports the commands' modules)
import skistune.paths as paths  # noqa: I001
import skistune.report as report_module

PNG = b"\x89PNG\r\n\x1a\n"
NEW = {"pareto": PNG + b"new pareto" * 1000, "latency": PNG + b"new latency" * 1000}


class _FullDisk:
    """A file object that takes half of ``fails_on`` and then raises ENOSPC, as a disk that fills mid-write."""

    def __init__(self, fh, fails_on: bytes):
        self._fh, self._fails_on = fh, fails_on

    def write(self, data):
        if data == self._fails_on:
            self._fh.write(data[: len(data) // 2])
            self._fh.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


@pytest.fixture
def full_disk_on_the_latency_plot(monkeypatch):
    """The report's figures stubbed (no study), and the disk full while the latency plot is written."""
    monkeypatch.setattr(report_module, "build_report", lambda study, storage=None, top_k=5: SimpleNamespace(
        storage="sqlite:///s.db"))
    monkeypatch.setattr(report_module, "report_tables", lambda rep: [])
    monkeypatch.setattr(report_module, "report_lines", lambda rep: [])
    monkeypatch.setattr(report_module, "render_plots", lambda rep: (dict(NEW), []))
    monkeypatch.setattr(report_module, "report_html", lambda rep, images, notes=(): "<html>new</html>")
    real_fdopen = os.fdopen
    monkeypatch.setattr(paths.os, "fdopen", lambda fd, *a, **kw: _FullDisk(real_fdopen(fd, *a, **kw), NEW["latency"]))


def _report(out, *args):
    return CliRunner().invoke(app, ["report", "t", "--out-dir", str(out), *args])


def test_a_full_disk_keeps_the_previous_plot_whole_and_says_which_file_in_one_line(tmp_path,
                                                                                  full_disk_on_the_latency_plot):
    out = tmp_path / "r"
    out.mkdir()
    old = {"pareto.png": PNG + b"old pareto", "latency-cdf.png": PNG + b"old latency", "report.html": b"<html>old"}
    for name, data in old.items():
        (out / name).write_bytes(data)
    r = _report(out, "--json")
    assert r.exit_code == 2
    line = f"[Errno 28] cannot write {out / 'latency-cdf.png'}: No space left on device"
    assert r.stderr == f"error: {line}\n"
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"error": line, "exit_code": 2}
    # the plot written before the error is the new one, whole; the one being written and those after it are the
    # previous ones, whole; no temporary file is left beside them
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {**old, "pareto.png": NEW["pareto"]}


def test_a_full_disk_leaves_no_partial_plot_in_a_new_folder(tmp_path, full_disk_on_the_latency_plot):
    out = tmp_path / "fresh"
    r = _report(out)
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "latency-cdf.png: No space left on device" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["pareto.png"]  # (no 0-byte or half latency-cdf.png)
    assert (out / "pareto.png").read_bytes() == NEW["pareto"]


def test_write_atomic_writes_bytes_exactly_and_text_as_utf8(tmp_path):
    target = tmp_path / "x.png"
    assert paths.write_atomic(target, NEW["pareto"]) == target and target.read_bytes() == NEW["pareto"]
    paths.write_atomic(target, "é\n")
    assert target.read_bytes() == "é\n".encode("utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]
