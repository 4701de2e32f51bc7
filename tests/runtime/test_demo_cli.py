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
