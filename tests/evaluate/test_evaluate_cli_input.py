"""`skistune evaluate` refuses bad input in one line (exit 2) before it prints anything about the workload."""
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skistune.cli import app

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def test_a_profile_of_another_model_is_refused_before_the_workload_notes(tmp_path):
    """The shipped H200 profile is llama-3-8b's: it was refused only when the simulation started, after the
    note that one of the preset's 2,000 requests does not fit SmolLM2's context, and after a warning that
    it was measured on another machine."""
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("{}\n")
    r = CliRunner().invoke(app, ["evaluate", str(cfg), "--profile", str(PROFILES / "cuda-llama-3-8b.json")])
    assert r.exit_code == 2
    assert r.output.splitlines() == ["error: profile 'cuda-llama-3-8b' was measured for llama-3-8b, not smollm2-135m: give "
                     "--model llama-3-8b to use it, or measure one with `skistune profile --model smollm2-135m`"]


def test_a_model_whose_weights_do_not_fit_memory_is_refused_before_it_is_built(tmp_path, monkeypatch):
    """`--mode run --model llama-3-8b` on a 23 GiB host built 60 GiB of float32 weights: the kernel's
    out-of-memory kill, with no message (a traceback where memory is capped)."""
    import skistune.profile.fingerprint as fingerprint
    from skistune.evaluate import evaluate
    from skistune.runtime.llm import Runtime
    from skistune.workloads import load_workload

    monkeypatch.setattr(fingerprint, "host_memory_bytes", lambda: 2 ** 29)  # 0.5 GiB: SmolLM2 needs 1.0
    monkeypatch.setattr(Runtime, "from_preset", classmethod(lambda *a, **k: pytest.fail("built the model")))
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("{}\n")
    message = ("model smollm2-135m: the runtime needs about 1.0 GiB of memory to build its weights (float32), more "
               "than this machine's 0.5 GiB; predict it with the simulator instead (--mode simulate)")
    for mode in ("run", "compare"):
        r = CliRunner().invoke(app, ["evaluate", str(cfg), "--mode", mode, "--requests", "2",
                                     "--profile", str(PROFILES / "cpu-smollm2-135m.json")])
        assert r.exit_code == 2
        assert [line for line in r.output.splitlines() if not line.startswith("warning: ")] == [f"error: {message}"]
    with pytest.raises(ValueError, match=re.escape(message)):
        evaluate({}, load_workload("chat", requests=2), mode="run")


def test_a_prediction_names_the_machine_it_is_for(tmp_path):
    """An H200 predicted from a CPU host: the table's title and the JSON name the profile's GPU (the only word
    on the machine had been the warning that the profile was measured elsewhere)."""
    import json

    cfg = tmp_path / "kv.yaml"
    cfg.write_text("{}\n")
    r = CliRunner().invoke(app, ["evaluate", str(cfg), "--model", "llama-3-8b", "--requests", "20", "--profile",
                                 str(PROFILES / "cuda-llama-3-8b-quick.json"), "--json"])
    assert r.exit_code == 0, r.output
    assert "predicted (simulator) for NVIDIA H200" in " ".join(r.output.split())
    out = json.loads(r.output.strip().splitlines()[-1])
    assert (out["profile"], out["device"], out["machine"]) == (
        "cuda-llama-3-8b-quick", "cuda", "NVIDIA H200 (profile cuda-llama-3-8b-quick)")


def test_a_comparison_replays_on_the_profiles_device(tmp_path, monkeypatch):
    """`--mode compare` with an H200 profile set its prediction against a float32 replay on this CPU."""
    import torch

    from skistune.runtime.llm import Runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(Runtime, "from_preset", classmethod(lambda *a, **k: pytest.fail("built the model")))
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("{}\n")
    r = CliRunner().invoke(app, ["evaluate", str(cfg), "--mode", "compare", "--model", "llama-3-8b", "--requests",
                                 "2", "--profile", str(PROFILES / "cuda-llama-3-8b-quick.json")])
    assert r.exit_code == 2
    assert r.output.splitlines()[-1] == ("error: this machine has no CUDA device; predict it with the simulator "
                                         "instead (--mode simulate)")
