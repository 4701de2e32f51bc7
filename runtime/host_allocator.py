"""Keep freed host memory in the process instead of handing it back to the OS after every step.

A CPU step allocates and frees the same large temporaries (gathered KV, attention scores, activations) in
every layer. glibc's malloc serves an allocation above its mmap threshold with a fresh ``mmap`` and
returns it with ``munmap`` on free, and trims the top of the heap once more than its trim threshold is
free; either way the next step's allocation of the same size faults in fresh zeroed pages. The threshold
adapts upwards as large blocks are freed, but not past the sizes a long-context decode step uses, so the
runtime's steps slowed down 2-2.5x at 16K tokens of KV in a batch (measured on the profiler's grid: batch
16 x context 2,048 took 0.90 s with 5.3 M minor page faults in the run, 0.36 s with 0.67 M after this).

`keep_freed_host_memory` sets the thresholds that PyTorch's CPU performance guide reaches with a
caching allocator (jemalloc/tcmalloc), through glibc's own ``mallopt``: allocations up to 32 MiB (the
largest mmap threshold glibc accepts) come from the heap, and up to `TRIM_THRESHOLD_BYTES` of free heap
stays with the process. The cost is that the process keeps its peak heap: what a serving process does
anyway (the CUDA caching allocator keeps device memory the same way). It runs once per process, for
runtimes on the CPU, and does nothing where the C library is not glibc.

`zeros_lazy` allocates the KV pool, which is large and mostly unused for a while, without writing it.
"""
from __future__ import annotations

import ctypes
import math
import platform
from contextlib import contextmanager

import numpy as np
import torch

# mallopt parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 2 ** 20  # glibc's upper limit on 64-bit systems (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 2 ** 30  # mallopt takes an int: at most 2 GiB - 1
TOP_PAD_BYTES = 64 * 2 ** 20  # grow the heap in steps this large (address space only until touched)

# torch's CPU allocator aligns every tensor to 64 bytes (c10's gAlignment, one cache line / AVX-512 vector)
ALIGNMENT_BYTES = 64

_tuned: bool | None = None  # None until tried; then whether glibc accepted every setting


def keep_freed_host_memory() -> bool:
    """Tell glibc's malloc to keep large freed blocks (see the module docstring); True when it took."""
    global _tuned
    if _tuned is None:
        _tuned = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            # mallopt returns 1 on success, 0 on a rejected value
            _tuned = all(mallopt(param, value) == 1 for param, value in (
                (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                (M_TOP_PAD, TOP_PAD_BYTES)))
    return _tuned


def zeros_lazy(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero tensor whose host pages are zeroed by the kernel when first touched, not written here.

    ``torch.zeros`` writes every byte, so a CPU runtime paid for its whole KV pool (a fraction of
    `kv_layout.CPU_KV_SPACE_BYTES`, ~1M page faults, seconds) in every `Runtime.with_config`, though a run
    touches only the blocks it uses. numpy's ``np.zeros`` uses ``calloc``, which is guaranteed to return
    zeroed memory and, for a large block, gets it as fresh anonymous pages from ``mmap`` that the kernel
    zero-fills on first touch. The buffer is over-allocated by `ALIGNMENT_BYTES` and sliced so that the
    tensor starts where torch's own allocator would put it (vectorised kernels may prefer it). Bytes are
    allocated and viewed as ``dtype``, which covers the dtypes numpy lacks (bfloat16). Devices other than
    the CPU get ``torch.zeros``.

    The cost moves, it does not vanish: a block's pages fault in when a step first writes it. In 4 KiB
    pages, not huge ones: numpy asks the kernel for transparent huge pages on buffers above 4 MiB, and where
    it tries to compact memory for them on a fault (``defrag`` at ``madvise``, as on this project's hosts,
    which then granted none), a 131-token prefill of SmolLM2 spent 22 ms writing its KV (``index_copy_``)
    into a fresh pool against 2 ms into a written one: the steps that hold a prefill ran 20-30% over the
    profile's, which times them on a written pool (`benchmarks/fidelity.py`, BENCHMARKS.md "Fidelity").
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    with _no_huge_pages():
        raw = np.zeros(nbytes + ALIGNMENT_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT_BYTES
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


@contextmanager
def _no_huge_pages():
    """numpy's allocations without its transparent-huge-page advice (`zeros_lazy`), restored after; a no-op on
    a numpy without the switch (a private one: ``_set_madvise_hugepage`` returns the previous setting)."""
    switch = getattr(getattr(np, "_core", np).multiarray, "_set_madvise_hugepage", None)
    if switch is None:
        yield
        return
    previous = switch(False)
    try:
        yield
    finally:
        switch(previous)
