"""A misspelt choice gets the near one suggested (the errors listed every choice, and left the reader to find it)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.config import did_you_mean


def test_a_near_miss_is_suggested_and_a_far_one_is_not():
    assert did_you_mean("capacty", ["capacity", "goodput", "energy"]) == " (did you mean capacity?)"
    assert did_you_mean("VLLM ", ["vllm", "sglang"]) == " (did you mean vllm?)"
    assert did_you_mean("zzz", ["vllm", "sglang"]) == ""
    assert did_you_mean("vllm", ["vllm"]) == ""  # (the value itself is no suggestion)


@pytest.mark.parametrize("argv, said", [
    (["optimize", "--slo", "p99=200ms", "--objective", "capacty"], "objective 'capacty' (did you mean capacity?)"),
    (["optimize", "--slo", "p99=200ms", "--space", "defualt"], "defualt (did you mean default?)"),
    (["optimize", "--slo", "p99=200ms", "--workload", "chatt"], "workload 'chatt' (did you mean chat?)"),
    (["optimize", "--slo", "p99=200ms", "--sampler", "tp"], "--sampler 'tp' (did you mean tpe?)"),
    (["optimize", "--slo", "p99=200ms", "--model", "smollm2-135"], "model 'smollm2-135' (did you mean smollm2-135m?)"),
    (["optimize", "--slo", "p99=200ms", "--profile", "cpu-smolm2-135m"], "(did you mean cpu-smollm2-135m?)"),
])
def test_the_commands_suggest_the_near_choice(tmp_path, monkeypatch, argv, said):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2 and said in r.stderr, r.output


def test_export_and_evaluate_suggest_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kv.yaml").write_text("batching:\n  max_num_seqs: 64\n")
    assert "--to 'vlm' (did you mean vllm?)" in CliRunner().invoke(app, ["export", "kv.yaml", "--to", "vlm"]).stderr
    r = CliRunner().invoke(app, ["evaluate", "kv.yaml", "--mode", "simulte"])
    assert r.exit_code == 2 and "--mode 'simulte' (did you mean simulate?)" in r.stderr
