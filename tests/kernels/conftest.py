"""Triton kernels run compiled on a CUDA GPU, else on the CPU under Triton's interpreter: the variable
must be set before any kernel module is imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
