"""Writing the files commands write: checked before any work (a search, a trace read) is spent, then written
whole or not at all."""
from __future__ import annotations

import os
import uuid
from pathlib import Path


def check_out_file(path: Path, option: str) -> None:
    """Refuse a file that ``option`` names where it cannot be written: its folder missing (a mistyped folder
    is an error, not a new folder) or the path a directory (a rename onto it would fail naming a temporary
    file, after the work)."""
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a directory (give a file name, e.g. {path / 'FILE'})")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: folder {folder} does not exist")


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to a new file beside ``path`` (created with the usual permissions, umask applied),
    flush it to disk, then rename it over ``path``: readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
