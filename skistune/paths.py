"""Writing the files commands write: checked before any work (a search, a trace read) is spent, then written
whole or not at all."""
from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path


def check_out_file(path: Path, option: str, inputs: tuple[Path, ...] = ()) -> None:
    """Refuse a file that ``option`` names where it cannot be written: its folder missing (a mistyped folder
    is an error, not a new folder) or a file, a folder that takes no new file (tried), the path a directory (a
    rename onto it would fail naming a temporary file, after the work), or one of the command's ``inputs``
    (writing would replace what was read). A name longer than the file system takes is refused too: stat
    fails on it, and had printed a raw "[Errno 36] File name too long"."""
    try:
        _check_out_file(path, option, inputs)
    except OSError as exc:  # (a name too long, a folder that cannot be searched)
        raise ValueError(f"{option} {path}: {_lower_first(exc.strerror) if exc.strerror else exc}") from None


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _check_out_file(path: Path, option: str, inputs: tuple[Path, ...]) -> None:
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a directory (give a file name, e.g. {path / 'FILE'})")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():  # (typo.yaml/x.yaml: the folder is there, as a file)
            raise ValueError(f"{option} {path}: {existing} is a file, not a folder")
        raise ValueError(f"{option} {path}: folder {folder} does not exist")
    _check_writable(folder, path, option)
    for source in inputs:  # samefile sees through links and other spellings of the path
        if path.exists() and source.exists() and os.path.samefile(path, source):
            raise ValueError(f"{option} {path}: is the input file {source}, which writing would overwrite "
                             "(give another file name)")


def check_existing_dir(path: Path, option: str) -> None:
    """Refuse a folder that ``option`` names for a command to write files in: missing (not created: a
    mistyped path is an error), not a folder, or one that takes no new file (tried): found before the work,
    not when the work reaches it."""
    try:
        _check_existing_dir(path, option)
    except OSError as exc:  # (a name too long for the file system: stat fails on it)
        raise ValueError(f"{option} {path}: {_lower_first(exc.strerror) if exc.strerror else exc}") from None


def _check_existing_dir(path: Path, option: str) -> None:
    if not path.exists():
        raise ValueError(f"{option} {path}: no such directory (give an existing one)")
    if not path.is_dir():
        raise ValueError(f"{option} {path}: not a directory")
    _check_writable(path, path, option)


def _check_writable(folder: Path, path: Path, option: str) -> None:
    """Create and remove a file in ``folder``, named as `write_atomic` names its temporary file: a folder's
    permission bits do not tell (root passes `os.access` everywhere) that /proc, a read-only mount or a full
    disk refuses new files, and a refusal after the work would lose it."""
    size, most = len(os.fsencode(path.name)), _name_max(folder)
    if size > most:  # (the rename onto it would fail, after the work)
        raise ValueError(f"{option} {path}: file name too long ({size} bytes; this file system takes at most "
                         f"{most})")
    exc = probe_folder(folder, temporary_name(folder, path.name))
    if exc is not None:
        raise ValueError(f"{option} {path}: cannot create a file in {folder} ({exc.strerror or exc})")


def probe_folder(folder: Path, name: str | None = None) -> OSError | None:
    """Create and remove a file in ``folder`` (named ``name``, else a probe's name): the error that refused it,
    or None. Permission bits do not tell (root passes `os.access` everywhere), a read-only mount does."""
    probe = folder / (name or f".skistune-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        return exc
    probe.unlink(missing_ok=True)
    return None


def folder_refuses(folder: Path) -> OSError | None:
    """Why ``folder`` (which may not exist yet) cannot be made and written to: its nearest existing ancestor is
    a file, or refuses a new file (`probe_folder`); None if it can."""
    place = folder
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        return NotADirectoryError(20, "Not a directory", str(place))
    return probe_folder(place)


def shipped_or_path(spec: str | os.PathLike, shipped: dict[str, Path], what: str) -> Path:
    """The file ``spec`` names: a file, or a bare name that is no file here (``cpu-smollm2-135m``), the shipped
    file of that name in ``shipped`` (name -> path: installed from a wheel, shipped files live inside the package,
    where no user would look for them); ``what`` names the kind in the error for an unknown bare name."""
    path = Path(spec)
    if path.exists() or path.suffix == ".json" or len(path.parts) != 1:
        return path
    if path.name in shipped:
        return shipped[path.name]
    from skistune.config import did_you_mean

    raise ValueError(f"{spec}{did_you_mean(spec, shipped)}: no such {what} file, nor a shipped {what} (shipped: "
                     f"{', '.join(sorted(shipped))})")


NAME_MAX = 255  # bytes in a file name: Linux's file systems (where the folder's own limit cannot be read)


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):  # (no such folder, or a system that does not say)
        return NAME_MAX


def temporary_name(folder: Path, name: str) -> str:
    """A new file name in ``folder`` for a file to be renamed to ``name``: ``.NAME.PID.RANDOM.tmp``, where the
    folder's longest name (NAME_MAX, 255 bytes on Linux) allows it. For a long ``name`` (a legal 250-byte one had
    been refused: "File name too long"), its start is kept and the rest replaced by a hash of it."""
    tail = f".{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    full = f".{name}{tail}"
    limit = _name_max(folder)
    if len(os.fsencode(full)) <= limit:
        return full
    digest = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    start = name
    while start and len(os.fsencode(f".{start}{digest}{tail}")) > limit:  # (whole characters: no half UTF-8)
        start = start[:-1]
    return f".{start}{digest}{tail}"


def write_atomic(path: Path, text: str | bytes) -> Path:
    """Write ``text`` (str as UTF-8, or bytes: a PNG) to a new file beside ``path`` (created with the usual
    permissions, umask applied), flush it to disk, then rename it over ``path``: readers see the old file or
    the new one, never a part, and a full disk leaves no 0-byte or truncated file (a report's plot had been).
    A symbolic link is written through (its target replaced, the link kept), and what is not a regular file
    (/dev/stdout, /dev/null, a pipe) is written to directly: a rename had replaced /dev/full, run as root,
    with a regular file (a tester's finding)."""
    path = Path(path)
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        try:
            with open(path, "wb") as fh:
                fh.write(data)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from None
        return path
    tmp = path.with_name(temporary_name(path.parent, path.name))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as exc:  # the temporary name is ours, not the user's: the error names the target
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from None
    return path
