"""Bad input to the fidelity and step-trace benchmarks: one line on stderr, exit code 2, before any model
loads (a tester's list: each of these had ended in a traceback, or in the kernel's out-of-memory kill)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_PROFILE = str(ROOT / "profiles" / "cuda-llama-3-8b.json")


@pytest.mark.parametrize("script,args,message", [
    ("fidelity.py", ["--traces", "/nonexistent", "--requests", "2"],
     "error: --traces /nonexistent: no azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv there"),
    ("fidelity.py", ["--rate-scale", "1e12"],
     "error: --rate-scale 1e+12: azure-conv's 0.8 req/s becomes 8e+11 req/s, above 1e+06 req/s"),
    ("fidelity.py", ["--profile", CUDA_PROFILE],
     "error: profile 'cuda-llama-3-8b' was measured for llama-3-8b, not smollm2-135m"),
    ("token_gaps.py", ["--profile", CUDA_PROFILE],
     "error: profile 'cuda-llama-3-8b' was measured for llama-3-8b, not smollm2-135m"),
    ("fidelity_steps.py", ["--rate-scale", "1e-9", "--workload", "bursty-chat"],
     "error: --rate-scale 1e-09: bursty-chat's 1 req/s becomes 1e-09 req/s, below 1e-06 req/s"),
    ("step_trace.py", ["--points", "prefill:8192x0"],
     "error: --points prefill:8192x0: sequences of up to 8193 tokens, more than smollm2-135m's context of 8192"),
])
def test_bad_input_is_one_line_and_exit_code_2(script, args, message):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode == 2 and r.stdout == "" and len(errors) == 1 and errors[0].startswith(message), r.stderr
    assert "Traceback" not in r.stderr
