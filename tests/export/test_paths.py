"""`skistune.paths`: the checks every command runs on its output file, and the atomic writer's errors."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from skistune.paths import check_out_file, write_atomic


def test_check_out_file_refuses_an_input_of_the_command(tmp_path):
    source = tmp_path / "in.yaml"
    source.write_text("x: 1\n")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match=r"--out .*in\.yaml: is the input file .*in\.yaml"):
        check_out_file(tmp_path / "sub" / ".." / "in.yaml", "--out", inputs=(tmp_path / "other.yaml", source))
    check_out_file(tmp_path / "out.yaml", "--out", inputs=(source,))  # a new file is not an input
    check_out_file(source, "--out")  # nothing to compare with: an existing file may be replaced


def test_write_atomic_errors_name_the_target_not_the_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "out.yaml"

    def refuse(path, *args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(FileNotFoundError) as err:
        write_atomic(target, "x: 1\n")
    assert str(err.value) == f"[Errno 2] cannot write {target}: No such file or directory"
    assert ".tmp" not in str(err.value) and list(tmp_path.iterdir()) == []


def test_write_atomic_replaces_the_file_whole(tmp_path):
    target = tmp_path / "out.yaml"
    target.write_text("old\n")
    assert write_atomic(target, "new\n") == target
    assert target.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["out.yaml"]


def test_a_link_is_written_through_and_kept(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "cfg.yaml"
    target.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    write_atomic(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"


def test_what_is_not_a_regular_file_is_written_to_not_replaced(tmp_path):
    """A rename over the path had replaced /dev/full (run as root) with a regular file, a tester's finding."""
    import stat
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_atomic(fifo, "through the pipe")
    reader.join(timeout=10)
    assert got == ["through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    write_atomic(Path(os.devnull), "discarded")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
