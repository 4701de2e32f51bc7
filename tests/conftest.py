"""Keeps the repository's root off the import path. `python -m pytest` puts the working directory first on
``sys.path``, and from the root the folder that installs as ``skistune.kernels`` is importable as a top-level
``kernels`` package too: it shadowed Hugging Face's ``kernels`` package, which transformers imports from 5.25
on (the reference the runtime tests compare with), and every test that loads transformers failed with
``cannot import name 'CUDAProperties' from 'kernels'``. The tests import skistune as installed (``pip install
-e .``), or, from a checkout that is not installed, through a ``sys.path`` entry other than the root itself:
benchmarks/gpu_session.sh puts on ``PYTHONPATH`` a scratch folder holding one link, ``skistune`` -> the
checkout's ``skistune/`` (inside which it links ``runtime``, ``kernels`` and ``searchspaces``). Only an entry
that resolves to the root is removed, so that folder stays."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]

# The signal tests send SIGINT to the commands they start. A shell starts a background job (`cmd &`, `nohup`)
# with SIGINT ignored, and a child inherits an ignored signal: run that way, every such test waited out its
# timeout and failed (9 tests, 5.5 minutes). A handled signal is reset to its default in a child, so the test
# process handles SIGINT as Python does by default, and its children get it as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
