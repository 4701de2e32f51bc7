"""What `skistune evaluate` prints: energy per output token in every mode (the optimizer's formula, with
whether power is measured or modeled), why requests were rejected (grouped, in the table), ``-`` for a
figure that does not exist in the compare table as in the others, and CLI option names in its errors."""
from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from skistune.cli import app
from skistune.runtime.metrics import Metrics, Percentiles

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


def _flat(text: str) -> str:
    """Words of a table's text, without its box lines."""
    return " ".join(text.translate(str.maketrans("│┃", "  ")).split())


def _text(renderable) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(renderable)
    return _flat(console.export_text())


def _metrics(rejections=None, tbt=(), output_tokens=2, **kw) -> Metrics:
    p = Percentiles.of([0.05])
    rejections = rejections or {}
    fields = dict(ttft_s=p, tbt_s=Percentiles.of(list(tbt)), e2e_s=p, tpot_s=Percentiles.of(list(tbt)),
                  duration_s=1.0, num_requests=2 + len(rejections), num_finished=2, num_rejected=len(rejections),
                  output_tokens=output_tokens, throughput_tok_per_s=2.0, throughput_req_per_s=2.0, kv_peak_bytes=1,
                  kv_capacity_bytes=2, preemptions=0, prefix_hit_tokens=0, prompt_tokens=4, busy_s=0.5,
                  rejections=rejections)
    return Metrics(**{**fields, **kw})


def _evaluate(cfg_text: str, tmp_path, *args: str):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(cfg_text)
    return CliRunner().invoke(app, ["evaluate", str(cfg), "--profile", PROFILE, *args])


def test_simulate_reports_energy_per_token_as_the_optimizer_computes_it_and_says_power_is_modeled(tmp_path):
    from skistune.objectives import energy_j_per_token
    from skistune.profile import load_profile
    from skistune.runtime.metrics import Percentiles as P

    r = _evaluate("{}\n", tmp_path, "--requests", "6", "--max-input", "64", "--max-output", "8", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    m = out["metrics"]
    metrics = _metrics(duration_s=m["duration_s"], busy_s=m["busy_s"], output_tokens=m["output_tokens"],
                       ttft_s=P.of([0.1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        power = load_profile(PROFILE).power
    assert out["energy"]["j_per_token"] == pytest.approx(energy_j_per_token(metrics, power), rel=1e-12)
    assert out["energy"]["power_source"] == "modeled"
    assert out["energy"]["basis"] == "power modeled x simulated busy/idle time"
    table = " ".join(r.stdout.split())
    assert f"energy {out['energy']['j_per_token']:.3f} J/token (power modeled x simulated busy/idle time)" in table
    assert "energy is modeled, no power meter readable" in table


def test_a_run_takes_its_power_model_without_measuring_a_profile(monkeypatch, tmp_path):
    """`--mode run` is not metered: energy is the power model applied to the run's measured time; the
    model is the given profile's, else the cached quick profile's, else the declared one (modeled)."""
    from skistune.evaluate import energy_figure, power_model
    from skistune.profile.power import modeled_power

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert power_model("smollm2-135m", PROFILE).source == "modeled"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached profile: nothing is measured
    import skistune.profile.measure as measure

    monkeypatch.setattr(measure, "profile_model", lambda *a, **k: pytest.fail("a profile was measured"))
    import os

    assert power_model("smollm2-135m") == modeled_power("cpu", os.cpu_count() or 1)
    figure = energy_figure(_metrics(), power_model("smollm2-135m"), measured_time=True)
    assert figure["basis"] == "power modeled x measured busy/idle time; the run itself is not metered"
    power = power_model("smollm2-135m")
    assert figure["j_per_token"] == pytest.approx(power.energy_j(0.5, 0.5) / 2)


def test_rejections_are_in_the_table_grouped_by_reason(tmp_path):
    r = _evaluate("offload:\n  device_kv_bytes: 1MiB\n", tmp_path, "--requests", "6", "--max-input", "200")
    assert r.exit_code == 0, r.output
    table = " ".join(r.stdout.split())
    assert "0 / 6 of 6" in table
    assert "why rejected needs 11-38 KV blocks, the cache holds 1: 6 requests" in table


def test_rejection_lines_group_reasons_that_differ_only_in_their_numbers_and_cap_the_list():
    from skistune.display import rejection_lines

    reasons = {"a": "needs 9 KV blocks, the cache holds 1", "b": "needs 12 KV blocks, the cache holds 1",
               "c": "prompt of 300 tokens exceeds max_num_batched_tokens 256 with chunked prefill off",
               "d": "prompt + output = 9000 tokens exceeds the model's context of 8192", "e": "reason x",
               "f": "reason y", "g": "needs 9 KV blocks, the cache holds 1"}
    assert rejection_lines(_metrics(reasons), limit=3) == [
        "needs 9-12 KV blocks, the cache holds 1: 3 requests",
        "prompt of 300 tokens exceeds max_num_batched_tokens 256 with chunked prefill off: 1 request",
        "prompt + output = 9000 tokens exceeds the model's context of 8192: 1 request",
        "2 other reasons: 2 requests (--json lists each request's)"]
    assert rejection_lines(_metrics()) == []


def test_the_compare_table_prints_dashes_where_a_figure_does_not_exist():
    """One output token per request: no TBT. The simulate table prints `-`; so does the compare table."""
    from skistune.evaluate import compare_metrics
    from skistune.evaluate_cli import comparison_table

    predicted, measured = _metrics(), _metrics()
    energy = {"predicted": {"j_per_token": 1.5, "power_source": "modeled"},
              "measured": {"j_per_token": float("inf"), "power_source": "modeled"}, "error": None}
    text = _text(comparison_table(compare_metrics(predicted, measured), predicted, measured, "t", energy))
    assert "nan" not in text and "inf" not in text
    assert "tbt p50 (ms) - - -" in text and "tbt p99 (ms) - - -" in text
    assert "energy (J/token: modeled power x time) 1.500 - -" in text
    assert "rejected 0 0" in text


def test_requests_on_a_trace_names_the_cli_options(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n12,3\n")
    r = _evaluate("{}\n", tmp_path, "--workload", str(trace), "--requests", "3")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert "error: --requests applies to presets; take part of a trace with --first or --sample" in r.output


@pytest.mark.slow
def test_run_and_compare_report_energy_from_the_measured_time(tmp_path):
    """The runtime has no meter here: the measured J/token is the profile's power model over the run's
    measured busy and idle time, labelled so, beside the prediction (and its error) in compare mode."""
    from skistune.objectives import energy_j_per_token
    from skistune.profile import load_profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        power = load_profile(PROFILE).power
    r = _evaluate("{}\n", tmp_path, "--mode", "compare", "--requests", "2", "--max-input", "16", "--max-output", "1",
                  "--no-speed-check", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for which in ("predicted", "measured"):
        m = out[which]
        metrics = _metrics(duration_s=m["duration_s"], busy_s=m["busy_s"], output_tokens=m["output_tokens"])
        assert out["energy"][which]["j_per_token"] == pytest.approx(energy_j_per_token(metrics, power), rel=1e-12)
    assert out["energy"]["measured"]["basis"].startswith("power modeled x measured busy/idle time")
    p, m = out["energy"]["predicted"]["j_per_token"], out["energy"]["measured"]["j_per_token"]
    assert out["errors"]["energy"] == pytest.approx((p - m) / m)
    assert not [name for name in out["errors"] if name.startswith("tier")]  # (no tier: no tier figure)
    assert out["device"] == "cpu" and out["profile"] and out["machine"].endswith(f"(profile {out['profile']})")
    table = _flat(r.stdout)
    assert "energy (J/token: modeled power x time)" in table and "tbt p99 (ms) - - -" in table
    assert ("energy, predicted: power modeled x simulated busy/idle time; measured: power modeled x measured "
            "busy/idle time; the run itself is not metered") in table
    assert "nan" not in table



def test_prefix_hits_at_readmissions_are_shown_apart():
    from skistune.display import summary_table

    shared = _text(summary_table(_metrics(prefix_hit_tokens=3)))
    assert "prefix-hit tokens 3 of 4 prompt tokens" in shared and "re-admissions" not in shared
    readmitted = _text(summary_table(_metrics(prefix_hit_tokens=3, readmission_hit_tokens=2)))
    assert "3 of 4 prompt tokens (2 at re-admissions after preemption)" in readmitted


def test_the_compare_table_shows_what_the_tiers_did():
    from skistune.evaluate import compare_metrics
    from skistune.evaluate_cli import comparison_table
    from skistune.runtime.metrics import TierMetrics

    def tiers(transfer_s, moved):
        return TierMetrics(peak_bytes={}, capacity_bytes={}, moved_bytes={"device->host": moved}, transfer_s=transfer_s,
                           stall_s=0.0, promotions=0, demotions=1, swapped_out=0, swapped_in=0, swap_fallbacks=0,
                           prefetched=0, prefetch_hit_rate=None, corrupt_blocks=0)

    predicted, measured = _metrics(tiers=tiers(0.322, 2 << 20)), _metrics(tiers=tiers(0.027, 2 << 20))
    text = _text(comparison_table(compare_metrics(predicted, measured), predicted, measured, "t"))
    assert "tier transfer time (ms) 322.000 27.000 +1092.6%" in text
    assert "tier bytes moved (MiB) 2.0 2.0 +0.0%" in text and "tier stall time (ms) 0.000 0.000 -" in text
    # a run's few copies take microseconds: shown, so that the error beside them is not that of 0.0 and 0.0
    predicted, measured = _metrics(tiers=tiers(0.0, 0)), _metrics(tiers=tiers(48e-6, 0))
    text = _text(comparison_table(compare_metrics(predicted, measured), predicted, measured, "t"))
    assert "tier transfer time (ms) 0.000 0.048 -100.0%" in text
    plain = _text(comparison_table(compare_metrics(_metrics(), _metrics()), _metrics(), _metrics(), "t"))
    assert "tier" not in plain


def test_a_simulated_tier_larger_than_the_profiled_machine_holds_is_noted(tmp_path, monkeypatch):
    """The search keeps tiers to what the profiled machine can give them; `evaluate --mode simulate` had
    priced a 100 TiB host tier on a 23.5 GiB machine without a word (a replay refuses it)."""
    import skistune.problem as problem_module

    monkeypatch.setattr(problem_module, "host_tier_limit", lambda profile, target: (1 << 30, 2 << 30))
    monkeypatch.setattr(problem_module, "disk_tier_limit", lambda profile: (None, None))  # (unknown: no note)
    notes = {}
    for size in ("512MiB", "8GiB"):
        config = tmp_path / f"{size}.yaml"
        config.write_text(f"offload:\n  host_kv_bytes: {size}\n  disk_kv_bytes: 1TiB\n")
        r = CliRunner().invoke(app, ["evaluate", str(config), "--workload", "chat", "--requests", "3",
                                     "--max-input", "32", "--max-output", "2", "--profile", PROFILE])
        assert r.exit_code == 0, r.output
        notes[size] = [line for line in r.output.splitlines() if line.startswith("note: offload.")]
    assert notes["512MiB"] == []
    assert notes["8GiB"] == ["note: offload.host_kv_bytes: 8GiB is more than the 1GiB the profiled machine can "
                             "give a host tier (70% of its 2GiB of memory, vLLM's limit for its CPU swap space, less "
                             "the model's weights and the device KV pool that share it on a CPU): simulated as "
                             "configured, but a replay there would not hold it"]
