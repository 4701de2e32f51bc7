"""`skistune demo`: completions end at the model's end of turn, and the table shows what the KV knobs did."""
import json

import pytest
from typer.testing import CliRunner

from skistune.cli import app


@pytest.mark.slow
def test_demo_stops_at_the_end_of_turn_and_counts_evicted_tokens(tmp_path):
    """SmolLM2 ends a short answer with <|im_end|> and then opens a new ChatML turn: the demo printed both.
    With H2O under a 16-token budget, the evicted tokens are a row of the table and a field of the JSON."""
    cfg = tmp_path / "h2o.yaml"
    cfg.write_text("eviction:\n  policy: h2o\n  budget_tokens: 16\n  recent_window: 8\n")
    r = CliRunner().invoke(app, ["demo", "--prompt", "The capital of France is", "--max-new-tokens", "64",
                                 "--config", str(cfg), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not any("<|im_start|>" in c or "<|im_end|>" in c for c in out["completions"])
    assert out["metrics"]["evicted_tokens"] > 0 and "evicted KV tokens" in r.stdout
    # which knobs served the prompts (a tester could not tell from the output), and where a completion starts
    assert out["config"] == str(cfg) and out["knobs"].startswith("eviction.policy=h2o, budget_tokens=16")
    assert f"config: {cfg}; knobs off skistune's defaults: eviction.policy=h2o" in r.stdout
    assert "The capital of France is → " in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("prompt_words", "config", "reason"), [
    (8200, "", "exceeds the model's context of 8192: 1 request"),
    (40, "offload:\n  device_kv_bytes: 737280\n", "KV blocks, the cache holds 1: 1 request"),  # one 16-token block
])
def test_demo_fails_when_every_prompt_is_rejected(tmp_path, prompt_words, config, reason):
    """A demo that served nothing exited 0 with an empty table: it is an error (one line, exit 2, no JSON)
    that says why the prompts were rejected, on stderr and, with --json, as stdout's JSON line."""
    args = ["demo", "--prompt", "word " * prompt_words, "--max-new-tokens", "4", "--json"]
    if config:
        (tmp_path / "kv.yaml").write_text(config)
        args += ["--config", str(tmp_path / "kv.yaml")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().count("\n") == 0  # (and with --json, that line as the one JSON object on stdout)
    assert json.loads(r.stdout) == {"error": r.stderr.strip().removeprefix("error: "), "exit_code": 2}
    assert r.stderr.startswith("error: every prompt was rejected (") and reason in r.stderr


@pytest.mark.slow
def test_a_rejected_prompt_shows_its_reason_not_an_empty_completion():
    r = CliRunner().invoke(app, ["demo", "--prompt", "word " * 8200, "--prompt", "Hi", "--max-new-tokens", "2",
                                 "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["completions"][0] is None and isinstance(out["completions"][1], str)
    assert "exceeds the model's context" in out["rejected"][0] and out["rejected"][1] is None
    assert "→ (rejected: " in r.stdout
    assert out["metrics"]["prompt_tokens"] < 100  # (the served prompt's: the rejected 8,200-word one had counted)
