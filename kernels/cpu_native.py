"""The compiled CPU kernel for paged decode attention (`paged_decode_cpu.c`), built on first use.

PyTorch on a CPU can only dequantize packed KV into a full-precision copy of the whole context and then
attend over it, so 8/4/2-bit KV cost more time than 16-bit instead of less. The C kernel reads each
sequence's own blocks through its block table (no padding to the batch's longest context), dequantizes
in registers and writes the eviction statistics as a side output.

Build: ``cc -O3 -march=native -fopenmp`` into ``$XDG_CACHE_HOME/skistune/kernels`` (``~/.cache`` by
default), keyed by the source, the compiler and this CPU's flags; a build takes about a second and
happens once per machine (one process builds, others wait on a lock beside it and use its build). The
library's sha256 and size are written beside it (``.so.sha256``) and checked before every load: a damaged
file is built again with a note, never loaded. Where the cache folder cannot be written, the kernel is
compiled into a temporary folder for the run (a warning says so). The library links the OpenMP runtime
torch has already loaded (same soname), so it shares torch's threads and thread count. Without a C compiler, or with ``SKISTUNE_CPU_KERNELS=torch``,
the PyTorch path runs instead (a warning says why, once).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch

from .cache import cpu_identity, exclusive, user_cache_dir

SOURCE = Path(__file__).with_name("paged_decode_cpu.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
ENV_SWITCH = "SKISTUNE_CPU_KERNELS"  # "native" (default) or "torch"


class _Side(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int32), ("group", ctypes.c_int32), ("data", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("ring", ctypes.c_void_p)]


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)


def _checksum(path: Path) -> str:
    """``<sha256> <size>`` of a file, as its sidecar records it."""
    data = path.read_bytes()
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}"


# a library without a checksum beside it: built by a skistune that recorded none, or a build cut short between
# its two renames; either way built again, but without calling it damaged (a tester's upgrade had read so)
UNCHECKED = "no checksum recorded beside it"


def _damage(target: Path) -> str | None:
    """Why the cached library ``target`` must not be loaded (None: it is the file that was built). Checked
    before loading: dlopen of a truncated library (a disk that filled, a copy cut short) had killed the
    process with SIGBUS, and a 0-byte one failed every run without being built again."""
    sidecar = target.with_name(target.name + ".sha256")
    try:
        recorded = sidecar.read_text().strip()
    except FileNotFoundError:
        return UNCHECKED
    except (OSError, UnicodeDecodeError) as exc:
        return f"its checksum file cannot be read: {getattr(exc, 'strerror', None) or exc}"
    try:
        size = target.stat().st_size
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    built_size = recorded.rpartition(" ")[2]
    if built_size != str(size):  # (the size first: a truncated file is told without reading it)
        return f"{size:,} bytes, {int(built_size):,} when built" if built_size.isdigit() else \
            "its checksum file is damaged"
    try:
        actual = _checksum(target)
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    return None if actual == recorded else "its contents do not match the checksum recorded when it was built"


def _compile(compiler: str, folder: Path, name: str) -> tuple[Path, str]:
    """Compile into a new temporary folder inside ``folder``; the library's path there and its checksum."""
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    built = tmp / name
    done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"{compiler} failed to build {SOURCE.name}: {last}")
    return built, _checksum(built)


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler and CPU: from the cache when its checksum holds, else
    compiled into it (one process at a time; the others wait and use its build)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS),
                                    cpu_identity()]).encode()).hexdigest()[:16]
    target = user_cache_dir("kernels") / f"paged_decode_cpu-{key}.so"
    if target.exists() and _damage(target) is None:
        return target
    held = contextlib.ExitStack()
    try:
        held.enter_context(exclusive(target))
    except OSError as exc:  # an unwritable cache: built for this process only (a second a run)
        return _build_uncached(compiler, target, exc)
    with held:
        if target.exists():  # (another process may have built it while this one waited)
            why = _damage(target)
            if why is None:
                return target
            if why != UNCHECKED:
                warnings.warn(f"the cached CPU attention kernel {target} is damaged ({why}); building it again",
                              RuntimeWarning, stacklevel=3)
        built, checksum = _compile(compiler, target.parent, target.name)
        try:
            # the library first, then its checksum: a reader that sees the new library before its checksum
            # finds them apart, takes the lock and so waits for this build to finish
            sidecar_tmp = built.with_name(built.name + ".sha256")
            sidecar_tmp.write_text(checksum + "\n")
            os.replace(built, target)
            os.replace(sidecar_tmp, target.with_name(target.name + ".sha256"))
        finally:
            shutil.rmtree(built.parent, ignore_errors=True)
        return target


def _build_uncached(compiler: str, target: Path, exc: OSError) -> Path:
    """Where the cache folder cannot be written: compiled into a temporary folder, loaded from there (the
    loaded library stays mapped once its file is gone) and removed at exit."""
    import atexit

    warnings.warn(f"CPU attention kernel not cached: cannot write {target.parent} ({exc.strerror or exc}); "
                  "it is compiled for this run only", RuntimeWarning, stacklevel=3)
    folder = Path(tempfile.mkdtemp(prefix="skistune-kernel-"))
    atexit.register(shutil.rmtree, folder, True)
    return _compile(compiler, folder, target.name)[0]


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (and a warning) where it cannot be built or is switched off."""
    if os.environ.get(ENV_SWITCH, "native") == "torch":
        return None
    compiler = _compiler()
    try:
        if compiler is None:
            raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(f"CPU attention kernel unavailable ({exc}); using the PyTorch path, which makes 8/4/2-bit "
                      "KV slower than 16-bit", RuntimeWarning, stacklevel=2)
        return None
    fn = lib.skistune_paged_decode
    p, i32 = ctypes.c_void_p, ctypes.c_int32
    fn.argtypes = [p, p, i32, i32, i32, i32, p, i32, p, p, p, p, i32, i32, ctypes.c_float,
                   ctypes.POINTER(_Side), ctypes.POINTER(_Side), p, i32]
    fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def supports(q: torch.Tensor, key, value) -> bool:
    """Whether the kernel can take this step: CPU, float32 queries and KV."""
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return False
    for side in (key, value):
        full = side.ring if side.quantized else side.data
        if full.dtype != torch.float32 or (side.quantized and side.scale.dtype != torch.float32):
            return False
    return available()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _side(side, group: int) -> _Side:
    return _Side(side.bits, group, _ptr(side.data), _ptr(side.scale), _ptr(side.zero), _ptr(side.ring))


def paged_decode(qd: torch.Tensor, key, value, meta, scale: float, layer: int,
                 want_stats: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode rows' attention ``[Bd, n_heads, D]`` and, if wanted, their probabilities summed per KV head
    ``[Bd, n_kv, width * block_size]`` (zero past a row's context and before its first slot)."""
    qd = qd.contiguous()
    batch, n_heads, d = qd.shape
    n_kv = key.data.shape[-2]
    tables = meta.decode_block_tables.contiguous()
    stats_len = tables.shape[1] * meta.block_size
    out = torch.empty_like(qd)
    stats = torch.empty(batch, n_kv, stats_len) if want_stats else None
    first = None if meta.decode_first_slots is None else meta.decode_first_slots[layer].contiguous()
    quantized = key.quantized or value.quantized
    value_group = value.data.shape[-1] * (8 // value.bits) // value.scale.shape[-1] if value.quantized else 0
    code = library().skistune_paged_decode(
        _ptr(qd), _ptr(out), batch, n_heads, n_kv, d, _ptr(tables), tables.shape[1], _ptr(meta.decode_context_lens),
        _ptr(first), _ptr(meta.decode_fp_start) if quantized else None,
        _ptr(meta.decode_slots) if quantized else None, meta.ring_tokens, meta.block_size, scale,
        ctypes.byref(_side(key, 0)), ctypes.byref(_side(value, value_group)), _ptr(stats), stats_len)
    if code != 0:
        raise RuntimeError(f"CPU attention kernel: {'unsupported shape' if code == 1 else 'out of memory'} "
                           f"(batch {batch}, {n_heads} heads, {n_kv} KV heads, head dim {d})")
    return out, stats
