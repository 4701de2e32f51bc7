"""The runtime keeps freed host memory: a step's large temporaries do not fault in fresh pages each time;
its KV pool is zeroed lazily: allocating it touches no pages."""
import platform
import subprocess
import sys

import pytest
import torch

from skistune.config import KVConfig
from skistune.runtime.host_allocator import ALIGNMENT_BYTES, keep_freed_host_memory, zeros_lazy
from skistune.runtime.kv_store import PagedKVStore
from tiny import TINY

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A layer loop shaped like a long-context decode step's temporaries (gathered keys and values, then
# larger attention intermediates), run for a few steps in a fresh process; prints the page faults of the
# steps after the first.
LAYER_LOOP = """
import resource, sys, torch
from skistune.runtime.host_allocator import keep_freed_host_memory
assert keep_freed_host_memory()
MB = 2 ** 20
def layer():  # its temporaries are freed when it returns
    temporaries = [torch.empty(n // 4) for n in (12 * MB, 12 * MB, 30 * MB, 30 * MB)]
    for t in temporaries:
        t.fill_(1.0)
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        layer()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
step()
print(sum(step() for _ in range(3)))
"""


def _later_step_faults() -> int:
    out = subprocess.run([sys.executable, "-c", LAYER_LOOP], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_settings_take_and_are_idempotent():
    assert keep_freed_host_memory() is True
    assert keep_freed_host_memory() is True


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_steps_after_the_first_reuse_the_pages_of_their_temporaries():
    pages_per_step = 10 * 84 * 2 ** 20 // 4096
    # three steps fault in less than a quarter of one step's pages (with glibc's own adaptive thresholds
    # the same loop faulted in every page of every step when run as a script: 214,720 faults a step)
    kept = _later_step_faults()
    assert kept < pages_per_step // 4, (kept, pages_per_step)


def test_model_on_cpu_tunes_the_allocator(monkeypatch):
    from skistune.runtime import model as model_module
    from skistune.runtime.presets import get_preset
    from skistune.runtime.weights import random_weights

    calls = []
    monkeypatch.setattr(model_module, "keep_freed_host_memory", lambda: calls.append(1) or True)
    spec = get_preset("smollm2-135m")
    model_module.LlamaModel(spec, random_weights(spec, dtype=torch.float32, device="cpu"))
    assert calls == [1]


# ---------------------------------------------------------------- zeros_lazy

# In a fresh process (imports and warm-up excluded): the page faults of building `tensors` (argv[1], an
# expression of ``n_bytes``, argv[2]), then those of writing one byte per 4 KiB page of them (the check's
# teeth: the same memory does fault in when used).
FAULTS_OF = """
import resource, sys, torch
from skistune.config import KVConfig
from skistune.runtime.host_allocator import zeros_lazy
from skistune.runtime.kv_layout import kv_block_bytes
from skistune.runtime.kv_store import PagedKVStore
from skistune.runtime.presets import get_preset
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def store_tensors(bits):  # every tensor of a SmolLM2 store of about n_bytes at `bits`
    spec = get_preset("smollm2-135m")
    config = KVConfig().with_knobs({"bitwidth.key_bits": bits, "bitwidth.value_bits": bits})
    store = PagedKVStore(spec, n_bytes // kv_block_bytes(spec, 16, 4, config), 16, torch.float32, "cpu", config)
    return [t for pair in store.layers for side in pair for t in (side.data, side.scale, side.zero, side.ring)
            if t is not None]
n_bytes = int(sys.argv[2])
zeros_lazy((1024,), torch.float32)
before = faults()
tensors = eval(sys.argv[1])
built = faults()
for t in tensors:
    t.view(-1).view(torch.uint8)[::4096].fill_(1)
print(sum(t.nbytes for t in tensors), built - before, faults() - built)
"""
GIB = 1 << 30


def _faults_of(expression: str, n_bytes: int) -> tuple[int, int, int]:
    """(bytes allocated, page faults allocating them, page faults writing them) in a fresh process."""
    out = subprocess.run([sys.executable, "-c", FAULTS_OF, expression, str(n_bytes)], capture_output=True,
                         text=True, check=True)
    nbytes, built, written = map(int, out.stdout.split())
    return nbytes, built, written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_zeros_lazy_is_zero_aligned_and_shaped(dtype):
    for shape in [(3, 5, 7), (1000, 16, 3, 64), (0, 4)]:
        t = zeros_lazy(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
        assert t.is_contiguous()
        assert t.data_ptr() % ALIGNMENT_BYTES == 0
        assert torch.count_nonzero(t) == 0


def test_zeros_lazy_is_writable_memory_of_its_own():
    a, b = zeros_lazy((64, 64), torch.float32), zeros_lazy((64, 64), torch.float32)
    a[1:].fill_(2.0)
    assert a.sum() == 2.0 * 63 * 64 and torch.count_nonzero(a[0]) == 0 and torch.count_nonzero(b) == 0


def test_zeros_lazy_off_the_cpu_is_torch_zeros():
    t = zeros_lazy((4, 8), torch.bfloat16, device="meta")
    assert t.device.type == "meta" and t.shape == (4, 8) and t.dtype == torch.bfloat16


LINUX = platform.system() == "Linux"


@pytest.mark.skipif(not LINUX, reason="relies on calloc getting fresh pages from mmap")
def test_allocating_1_gib_lazily_touches_almost_no_pages():
    nbytes, built, written = _faults_of("[zeros_lazy((n_bytes // 2,), torch.bfloat16)]", GIB)
    assert nbytes == GIB
    assert built < GIB // 4096 // 1000, built  # torch.zeros faults in all 262,144 pages
    # writing faults the memory in (fewer faults than pages where the kernel maps transparent huge pages)
    assert written > 100 * max(built, 1), (built, written)


@pytest.mark.skipif(not LINUX, reason="relies on calloc getting fresh pages from mmap")
@pytest.mark.parametrize("bits", [16, 4])
def test_building_a_kv_store_touches_almost_no_pages(bits):
    nbytes, built, written = _faults_of(f"store_tensors({bits})", GIB)
    assert nbytes > GIB * 0.99, nbytes  # the blocks of every tensor of every side (quantized: plus the rings)
    assert built < nbytes // 4096 // 1000, (built, nbytes)
    assert written > 100 * max(built, 1), (built, written)


@pytest.mark.parametrize("bits", [16, 4])
def test_kv_store_tensors_are_zero_and_aligned(bits):
    config = KVConfig().with_knobs({"bitwidth.key_bits": bits, "bitwidth.value_bits": bits})
    store = PagedKVStore(TINY, 8, 4, torch.float32, "cpu", config)
    tensors = [t for pair in store.layers for side in pair for t in (side.data, side.scale, side.zero, side.ring)
               if t is not None]
    assert len(tensors) == (2 * TINY.n_layers if bits == 16 else 8 * TINY.n_layers)
    for t in tensors:
        assert t.data_ptr() % ALIGNMENT_BYTES == 0 and torch.count_nonzero(t) == 0


def test_zeros_lazy_asks_for_no_huge_pages_and_leaves_numpy_as_it_was():
    """Where the kernel compacts memory for transparent huge pages on a fault (``defrag`` at ``madvise``), a
    prefill that wrote its KV into a fresh pool advised for them spent 22 ms of a 230-ms step faulting pages
    in. The pool's mapping must carry no huge-page advice (``hg`` in its flags in /proc/self/smaps, where
    numpy's advice puts it), and numpy's own setting must come back."""
    import re
    from pathlib import Path

    import numpy as np

    switch = getattr(np, "_core", np).multiarray._set_madvise_hugepage
    before = switch(True)
    try:
        t = zeros_lazy((64 << 20,), torch.float32)  # 256 MiB: far above numpy's 4-MiB threshold
        assert switch(True) is True  # (numpy's advice was on before the call, and is on again after it)
        middle = t.data_ptr() + t.numel() * t.element_size() // 2  # (numpy advises from a 2-MiB boundary on)
        smaps = Path("/proc/self/smaps")
        if smaps.is_file():  # (Linux)
            flags = [re.search(r"VmFlags:(.*)", block).group(1).split()
                     for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps.read_text())
                     if (lambda lo, hi: lo <= middle < hi)(*(int(x, 16) for x in block.split(None, 1)[0].split("-")))]
            assert len(flags) == 1 and "hg" not in flags[0], flags
        assert float(t[:: 1 << 20].sum()) == 0.0
    finally:
        switch(before)
