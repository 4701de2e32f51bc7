"""`skistune evaluate`: what a user test found in its table, its JSON and its options (the workload seed under
optimize's name, the prefetch hit rate of a config that prefetches nothing, swap fallbacks, req/s rounded to
0.02, the tier rows' errors missing from the JSON, oversized tiers' notes, a run without the machine's notes)."""
from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from skistune.cli import app
from skistune.config import KVConfig
from skistune.profile.profile import CPU_HOST_NOTE
from skistune.runtime.metrics import Metrics, Percentiles, TierMetrics

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")
SMALL = ("--requests", "3", "--max-input", "32", "--max-output", "2")
HOST_TIER = "offload:\n  host_kv_bytes: 64MiB\n"


def _text(renderable) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return " ".join(console.export_text().translate(str.maketrans("│┃", "  ")).split())


def _tiers(**kw) -> TierMetrics:
    fields = dict(peak_bytes={"host": 0}, capacity_bytes={"host": 1 << 20}, moved_bytes={"host->device": 1 << 20},
                  transfer_s=0.01, stall_s=0.0, promotions=16, demotions=16, swapped_out=0, swapped_in=0,
                  swap_fallbacks=0, prefetched=0, prefetch_hit_rate=0.0, corrupt_blocks=0)
    return TierMetrics(**{**fields, **kw})


def _metrics(**kw) -> Metrics:
    p = Percentiles.of([0.05])
    fields = dict(ttft_s=p, tbt_s=p, e2e_s=p, tpot_s=p, duration_s=1.0, num_requests=2, num_finished=2,
                  num_rejected=0, output_tokens=2, throughput_tok_per_s=2.0, throughput_req_per_s=2.0,
                  kv_peak_bytes=1, kv_capacity_bytes=2, preemptions=0, prefix_hit_tokens=0, prompt_tokens=4,
                  busy_s=0.5)
    return Metrics(**{**fields, **kw})


def _evaluate(tmp_path, config: str, *args: str):
    path = tmp_path / "kv.yaml"
    path.write_text(config)
    return CliRunner().invoke(app, ["evaluate", str(path), "--profile", PROFILE, *args])


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- the workload seed under optimize's name ----

def test_evaluate_takes_the_workload_seed_under_optimizes_name(tmp_path):
    """A tuned file's figures are reproduced with "the same workload options": optimize's --workload-seed had
    been "No such option" here; --seed keeps working."""
    aliased = _json(_evaluate(tmp_path, "{}\n", *SMALL, "--workload-seed", "3", "--json"))
    assert aliased["workload_digest"] == _json(_evaluate(tmp_path, "{}\n", *SMALL, "--seed", "3", "--json"))[
        "workload_digest"]
    assert aliased["workload_digest"] != _json(_evaluate(tmp_path, "{}\n", *SMALL, "--json"))["workload_digest"]
    assert "seed=3" in aliased["workload"]
    assert "--workload-seed" in CliRunner().invoke(app, ["evaluate", "--help"]).output


# ---- the summary table ----

@pytest.mark.parametrize("tiers, prefetch, shown", [
    # every promotion on demand counts as a prefetch miss: the rate was 0% with prefetch off
    (_tiers(), "off", "n/a (prefetch off)"),
    (_tiers(), "blocks", "n/a (nothing prefetched)"),
    (_tiers(), None, "n/a (nothing prefetched)"),  # (a caller that does not say what the config does)
    (_tiers(), "layers", "n/a (layer-wise prefetch)"),
    (_tiers(prefetched=8, prefetch_hit_rate=0.5), "blocks", "50%"),
    (_tiers(prefetched=8, prefetch_hit_rate=0.0), "blocks", "0%"),  # prefetched, none used in time: a real 0%
    (_tiers(prefetched=8, prefetch_hit_rate=None), "blocks", "n/a (no promoted block used)"),
])
def test_the_prefetch_hit_rate_says_why_there_is_none(tiers, prefetch, shown):
    from skistune.display import summary_table

    text = _text(summary_table(_metrics(tiers=tiers), prefetch=prefetch))
    assert f"transfers / stalls, prefetch hits 0.010 / 0.000 s, {shown}" in text


def test_prefetch_mode_reads_the_config():
    from skistune.display import prefetch_mode

    assert prefetch_mode(KVConfig()) == "off"
    assert prefetch_mode(KVConfig.from_dict({"prefetch": {"enabled": True, "unit": "layers"}})) == "layers"
    assert prefetch_mode(KVConfig.from_dict({"prefetch": {"enabled": True}})) == "blocks"


def test_swap_fallbacks_are_in_the_table_when_there_are_any():
    from skistune.display import summary_table

    assert "swaps recomputed instead (no host room) 3" in _text(summary_table(_metrics(tiers=_tiers(swap_fallbacks=3))))
    assert "recomputed" not in _text(summary_table(_metrics(tiers=_tiers())))


@pytest.mark.parametrize("rate, shown", [(0.01548, "0.0155"), (2.0, "2.00"), (15.48, "15.5"), (0.09996, "0.100"),
                                         (1548.3, "1,550"), (0.0, "0"), (float("nan"), "-")])
def test_requests_per_second_are_printed_to_three_significant_digits(rate, shown):
    """0.01548 req/s (a long trace) had printed as 0.02 req/s, 2 decimals."""
    from skistune.display import summary_table

    assert f"2.0 tok/s, {shown} req/s" in _text(summary_table(_metrics(throughput_req_per_s=rate)))


# ---- notes: tiers larger than the profiled machine holds, and the machine's in a run ----

def test_a_simulated_oversized_tier_is_noted_on_stderr_and_in_the_json(tmp_path, monkeypatch):
    import skistune.problem as problem_module

    monkeypatch.setattr(problem_module, "host_tier_limit", lambda profile, target: (1 << 30, 2 << 30))
    r = _evaluate(tmp_path, "offload:\n  host_kv_bytes: 1TiB\n", *SMALL, "--json")
    out = _json(r)
    [note] = out["notes"]
    assert note.startswith("offload.host_kv_bytes: 1TiB is more than the 1GiB the profiled machine can give a "
                           "host tier")
    assert f"note: {note}" in r.stderr.splitlines()  # (on stderr: --json's last line stays the one object)
    assert all("offload.host_kv_bytes" not in line for line in r.stdout.strip().splitlines()[:-1])
    assert _json(_evaluate(tmp_path, HOST_TIER, *SMALL, "--json"))["notes"] == []


@pytest.mark.parametrize("device, config, expected", [
    ("cpu", HOST_TIER, (CPU_HOST_NOTE,)),
    ("cpu", "offload:\n  host_kv_bytes: 64MiB\n  disk_kv_bytes: 256MiB\n", (CPU_HOST_NOTE,)),
    ("cpu", "{}\n", ()),  # no tier: no transfer to say anything of, as a prediction says nothing
    ("cuda", HOST_TIER, ()),  # real device <-> host copies
])
def test_a_run_carries_the_machine_notes_a_prediction_of_the_same_config_carries(device, config, expected):
    """The runtime says it (every run: evaluate's, a validation's, the API's), not one command."""
    from skistune.runtime.llm import Runtime

    runtime = SimpleNamespace(config=KVConfig.from_dict(yaml.safe_load(config)),
                              model=SimpleNamespace(device=SimpleNamespace(type=device)))
    assert Runtime._machine_notes(runtime) == expected


@pytest.mark.slow
def test_a_run_with_a_host_tier_on_the_cpu_says_so_and_prints_no_0_percent_prefetch_rate(tmp_path):
    r = _evaluate(tmp_path, HOST_TIER, "--mode", "run", *SMALL, "--json")
    out = _json(r)
    assert out["metrics"]["notes"] == [CPU_HOST_NOTE] and out["notes"] == []
    table = " ".join(r.stdout.split())
    assert f"note {CPU_HOST_NOTE}" in table and "n/a (prefetch off)" in table


@pytest.mark.slow
def test_compare_json_has_the_tier_rows_errors_and_the_oversized_tier_notes(tmp_path, monkeypatch):
    """The table printed the tier rows' errors; `errors` in the JSON had only the latency, throughput, KV
    and energy figures."""
    import skistune.problem as problem_module
    from skistune.evaluate import relative_error

    monkeypatch.setattr(problem_module, "host_tier_limit",
                        lambda profile, target: (1 << 20, 64 << 30))  # (memory: the pool fits)
    # (a device pool of 9 blocks for 6 requests: preempted sequences swap out to the host and back)
    config = "offload:\n  host_kv_bytes: 64MiB\n  device_kv_bytes: 8MiB\nbatching:\n  preemption: swap\n"
    r = _evaluate(tmp_path, config, "--mode", "compare", "--requests", "6", "--max-input", "48", "--max-output",
                  "16", "--workload-seed", "1", "--no-speed-check", "--json")
    out = _json(r)
    predicted, measured = out["predicted"]["tiers"], out["measured"]["tiers"]
    errors = out["errors"]
    assert measured["moved_bytes"] and errors["tier bytes moved"] is not None  # (KV did move: a real error)

    def same(key: str):  # (the JSON's error is of the figures in ms, as the table's: equal to rounding)
        error = relative_error(predicted[key], measured[key])
        return error if error is None else pytest.approx(error, rel=1e-12)

    assert errors["tier transfer time"] == same("transfer_s") and errors["tier stall time"] == same("stall_s")
    assert errors["tier bytes moved"] == relative_error(sum(predicted["moved_bytes"].values()),
                                                        sum(measured["moved_bytes"].values()))
    [note] = out["notes"]
    assert note.startswith("offload.host_kv_bytes: 64MiB is more than the 1MiB") and f"note: {note}" in r.stderr
    assert CPU_HOST_NOTE in out["predicted"]["notes"] and CPU_HOST_NOTE in out["measured"]["notes"]
    assert "seed=1" in out["workload"]
