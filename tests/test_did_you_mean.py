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


def test_an_empty_demo_prompt_names_the_option_before_loading_the_model(monkeypatch):
    """`demo -p ""` had said "request p0: empty prompt", the runtime's own id, after loading the model."""
    import skistune.runtime.llm as llm

    monkeypatch.setattr(llm.Runtime, "from_preset", lambda *a, **k: pytest.fail("the model was loaded"))
    r = CliRunner().invoke(app, ["demo", "-p", "The sky is", "-p", " "])
    assert r.exit_code == 2 and "error: --prompt number 2: empty; give some text to complete" in r.stderr


def test_export_takes_target_as_optimize_names_the_engine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kv.yaml").write_text("batching:\n  max_num_seqs: 64\n")
    by_to, by_target = (CliRunner().invoke(app, ["export", "kv.yaml", option, "vllm"]) for option in ("--to", "--target"))
    assert by_to.exit_code == by_target.exit_code == 0 and by_to.stdout == by_target.stdout
