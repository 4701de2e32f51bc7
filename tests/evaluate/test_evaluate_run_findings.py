"""`skistune evaluate`: what a QA pass of the runtime found in its output (disk blocks lost to a full disk shown
nowhere, a run silent about a disk tier larger than the disk, run and simulate --json with different keys,
prefetch hit rate 0.0 beside "n/a", compare without the eviction and tier counts, Ctrl-C with --json ending
without a JSON line)."""
from __future__ import annotations

import importlib
import json

import pytest

from skistune.config import KVConfig
from skistune.runtime.metrics import TierMetrics

from test_evaluate_findings import SMALL, _evaluate, _metrics, _text  # (one set of helpers)


def _tiers(**kw) -> TierMetrics:
    fields = dict(peak_bytes={"device": 0, "host": 0, "disk": 3 << 20}, capacity_bytes={"host": 0, "disk": 4 << 20},
                  moved_bytes={"device->disk": 1 << 20}, transfer_s=0.01, stall_s=0.0, promotions=2, demotions=6,
                  swapped_out=0, swapped_in=0, swap_fallbacks=0, prefetched=0, prefetch_hit_rate=None,
                  corrupt_blocks=0)
    return TierMetrics(**{**fields, **kw})


def _json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- a full disk ----

def test_the_table_says_when_disk_blocks_were_lost_or_corrupt():
    """A disk that refused writes showed as one warning on stderr; the table and JSON claimed every block
    written."""
    from skistune.display import summary_table

    text = _text(summary_table(_metrics(tiers=_tiers(disk_write_errors=5, corrupt_blocks=1))))
    assert ("disk write errors 5 blocks lost (disk full, over quota or I/O error): recomputed when needed; not in "
            "KV moved, in the disk peak") in text
    assert "corrupt disk blocks 1 block failed the checksum check: recomputed" in text
    plain = _text(summary_table(_metrics(tiers=_tiers())))
    assert "disk write errors" not in plain and "corrupt" not in plain
    assert _metrics(tiers=_tiers(disk_write_errors=5)).to_dict()["tiers"]["disk_write_errors"] == 5


def test_a_run_notes_a_disk_tier_larger_than_the_disk_it_lives_on(monkeypatch, tmp_path):
    """`--mode simulate` noted a disk tier larger than the profiled disk's free space; `--mode run` said
    nothing (a comment claimed the run refused it). A run notes it from the free space where its file lives."""
    import skistune.problem as problem_module
    import skistune.profile.transfers as transfers
    from skistune.evaluate import tier_notes

    monkeypatch.setenv("SKISTUNE_DISK_DIR", str(tmp_path))
    monkeypatch.setattr(transfers, "disk_free_bytes", lambda directory: 10 << 30)
    big = KVConfig.from_dict({"offload": {"disk_kv_bytes": 16 << 30}})
    assert tier_notes(big, "run") == [
        f"offload.disk_kv_bytes: 16GiB is more than the 9GiB this machine can give a disk tier (90% of the 10GiB "
        f"free in {tmp_path}, where the run keeps its file): served as configured, but blocks the disk cannot take "
        "are lost and recomputed (disk write errors); lower it, or set SKISTUNE_DISK_DIR to a folder on a larger disk"]
    assert tier_notes(KVConfig.from_dict({"offload": {"disk_kv_bytes": 8 << 30}}), "run") == []
    assert tier_notes(KVConfig(), "run") == []
    # compare replays here too: the run's note, unless the profiled machine's already names the disk tier
    monkeypatch.setattr(problem_module, "oversized_tier_notes", lambda config, profile, target: [])
    assert tier_notes(big, "compare") == tier_notes(big, "run")
    monkeypatch.setattr(problem_module, "oversized_tier_notes",
                        lambda config, profile, target: ["offload.disk_kv_bytes: x"])
    assert tier_notes(big, "compare") == ["offload.disk_kv_bytes: x"] == tier_notes(big, "simulate")


# ---- the compare table ----

def test_the_compare_table_has_the_eviction_swap_and_disk_counts_of_both_sides():
    from skistune.evaluate import compare_metrics
    from skistune.evaluate_cli import comparison_table

    predicted = _metrics(preemptions=3, evicted_tokens=120, tiers=_tiers(swapped_out=2, swap_fallbacks=1))
    measured = _metrics(preemptions=3, evicted_tokens=118,
                        tiers=_tiers(swapped_out=2, swap_fallbacks=1, disk_write_errors=4, corrupt_blocks=1))
    text = _text(comparison_table(compare_metrics(predicted, measured), predicted, measured, "t"))
    for row in ("preemptions 3 3", "evicted KV tokens 120 118", "preemptions swapped out 2 2",
                "swaps recomputed instead (no host room) 1 1", "demoted blocks 6 6", "promoted blocks 2 2",
                "disk write errors (blocks lost) 0 4", "corrupt disk blocks 0 1"):
        assert row in text
    plain = _text(comparison_table(compare_metrics(_metrics(), _metrics()), _metrics(), _metrics(), "t"))
    assert "evicted" not in plain and "swapped" not in plain and "disk" not in plain
    host_only = _metrics(tiers=_tiers(capacity_bytes={"host": 1 << 20, "disk": 0}))
    text = _text(comparison_table(compare_metrics(host_only, host_only), host_only, host_only, "t"))
    assert "demoted blocks" in text and "disk write errors" not in text  # (no disk tier: no disk rows)


# ---- Ctrl-C and SIGTERM ----

@pytest.mark.parametrize("signal_name, code", [("interrupted", 130), ("terminated", 143)])
def test_a_stopped_evaluate_ends_its_json_with_why(monkeypatch, tmp_path, signal_name, code):
    """Ctrl-C with --json printed nothing on stdout (exit 130); optimize ends with {"stopped": ...}."""
    from skistune.signals import Terminated

    def stopped(*args, **kwargs):
        raise Terminated() if signal_name == "terminated" else KeyboardInterrupt()

    monkeypatch.setattr(importlib.import_module("skistune.evaluate"), "evaluate", stopped)
    r = _evaluate(tmp_path, "{}\n", *SMALL, "--json")
    assert r.exit_code == code
    assert _json(r) == {"stopped": signal_name, "exit_code": code, "mode": "simulate"}
    # (a simulation was stopped: the line had spoken of a replay whatever the mode)
    assert f"{signal_name}: no figures (a simulation stopped part way is not reported)" in r.stderr
    r = _evaluate(tmp_path, "{}\n", *SMALL)
    assert r.exit_code == code and "stopped" not in r.stdout  # (no --json: no JSON)


# ---- run and simulate: the same JSON ----

@pytest.mark.slow
def test_run_and_simulate_json_have_the_same_keys_and_a_run_has_the_disk_note(monkeypatch, tmp_path):
    import skistune.profile.transfers as transfers

    monkeypatch.setattr(transfers, "disk_free_bytes", lambda directory: 1 << 20)
    config = "offload:\n  disk_kv_bytes: 4MiB\n"
    simulated, run = (_evaluate(tmp_path, config, *SMALL, "--mode", mode, "--json") for mode in ("simulate", "run"))
    assert simulated.exit_code == 0 and run.exit_code == 0, run.output
    simulated, out = _json(simulated), _json(run)
    assert set(out) == set(simulated)
    assert out["profile"] == simulated["profile"]  # (the profile given: a run reads its power model)
    assert out["device"] == "cpu" and out["machine"].endswith("(this machine)")
    [note] = out["notes"]
    assert note.startswith("offload.disk_kv_bytes: 4MiB is more than the 921.6 KiB this machine can give a disk tier")
    assert f"note: {note}" in run.stderr


def test_a_tuned_file_evaluated_on_another_workload_or_rate_says_which_its_figures_are_for(tmp_path):
    from skistune.evaluate import tuned_workload_note
    from skistune.workloads import load_workload

    w = load_workload("chat", requests=100)
    provenance = {"workload": {"source": w.source, "requests": 100}, "predicted": {"rate_scale": 0.0268}}
    assert tuned_workload_note(provenance, w, 0.0268) is None  # (the workload and rate optimize predicted at)
    note = tuned_workload_note(provenance, w, None)  # (evaluate's default: the workload's own rate)
    # (a file that records no options: only the rate differs, so these requests at the recorded scale; the
    # options that rebuild a workload are tests/evaluate/test_evaluate_tuned_file.py's)
    assert note.endswith("at x1: to check them, evaluate these requests at --rate-scale 0.0268")
    other = load_workload("chat", requests=2000)
    assert "this is 2000 requests of" in tuned_workload_note(provenance, other, 0.0268)
    assert tuned_workload_note({}, w, None) is None  # (a config written by hand)
    r = _evaluate(tmp_path, "provenance:\n  workload: {source: 'preset:chat requests=100', requests: 100}\n"
                            "  predicted: {rate_scale: 0.0268}\n", *SMALL, "--json")
    notes = _json(r)["notes"]  # (printed on stderr and in the JSON alike)
    assert any(n.startswith("the config's predicted figures (its provenance) are for 100 requests") for n in notes)


@pytest.mark.slow
def test_a_run_whose_arrivals_span_a_while_says_so_before_it_waits_for_them(tmp_path):
    """A run at a low rate had waited 100 s in silence off a terminal (the spinner shows on one only)."""
    r = _evaluate(tmp_path, "{}\n", "--requests", "2", "--max-input", "16", "--max-output", "2", "--rate", "0.2",
                  "--mode", "run")
    assert r.exit_code == 0, r.output
    assert "note: a run replays the arrivals in real time: these 2 requests arrive over" in r.stderr
