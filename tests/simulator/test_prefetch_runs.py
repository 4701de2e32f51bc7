"""The simulator prefetches as the runtime does while a request decodes alone: a fast-forwarded run of decode
steps had skipped the per-step prefetch, so that a waiting request's cached prefix came up on demand in the
prediction (4 blocks prefetched) and ahead of use in the run (37)."""
import json
from pathlib import Path

from typer.testing import CliRunner

from skistune.cli import app

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


def test_a_waiting_requests_prefix_is_prefetched_while_another_decodes(tmp_path):
    # A's prefix [1, 2] is pushed to the host tier by three fillers; a fourth decodes 20 tokens alone
    # (max_num_seqs 1) while a request with A's prefix waits
    rows = [(0, [1, 2], 600, 2), (5000, [3, 4], 600, 2), (10000, [5, 6], 600, 2), (15000, [7, 8], 600, 2),
            (20000, [10, 11], 1000, 20), (20001, [1, 2], 600, 2)]
    trace = tmp_path / "mc.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                             for t, h, i, o in rows))
    config = tmp_path / "pf.yaml"
    config.write_text("offload:\n  device_kv_bytes: 96MiB\n  host_kv_bytes: 128MiB\nprefetch:\n  enabled: true\n"
                      "  depth: 2\nbatching:\n  max_num_seqs: 1\n")
    r = CliRunner().invoke(app, ["evaluate", str(config), "--workload", str(trace), "--block-tokens", "16",
                                 "--jitter", "0.001", "--profile", PROFILE, "--json"])
    assert r.exit_code == 0, r.output
    tiers = json.loads(r.stdout.strip().splitlines()[-1])["metrics"]["tiers"]
    assert tiers["promotions"] == tiers["prefetched"] == 37 and tiers["prefetch_hit_rate"] == 1.0
