"""The runtime keeps freed host memory: a step's large temporaries do not fault in fresh pages each time."""
import platform
import subprocess
import sys

import pytest
import torch

from skistune.runtime.host_allocator import keep_freed_host_memory

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
