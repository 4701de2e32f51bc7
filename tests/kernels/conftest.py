"""Triton kernels run compiled on a CUDA GPU, else on the CPU under Triton's interpreter: the variable
must be set before any kernel module is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(params=["native", "torch"])
def cpu_decode(request, monkeypatch):
    """Run a test with each CPU decode implementation: the compiled kernel (`cpu_native`) and the PyTorch
    path it replaces (still the fallback where no compiler exists)."""
    from skistune.kernels import attention
    if request.param == "torch":
        monkeypatch.setattr(attention.cpu_native, "supports", lambda *a: False)
    else:
        assert attention.cpu_native.available(), "the CPU attention kernel did not build on this machine"
    return request.param


@pytest.fixture
def torch_decode(monkeypatch):
    """The PyTorch decode path (its length groups), whatever else this machine has."""
    from skistune.kernels import attention
    monkeypatch.setattr(attention.cpu_native, "supports", lambda *a: False)
