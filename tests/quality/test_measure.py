"""A quality profile measured end to end on the real model, at a tiny grid: written as it goes, resumed
without measuring again, and predicting what it measured."""
import json
from dataclasses import replace

import pytest

from skistune.config import KVConfig
from skistune.quality.grid import QUICK
from skistune.quality.measure import build_profile, measure_quality
from skistune.quality.scoring import SCORING_KV_BYTES

pytestmark = pytest.mark.slow

TINY = replace(QUICK, name="tiny", windows=1, window_tokens=128, continuation=8, bits=(8, 2), value_groups=(32,),
               fractions=(0.5,), needle_placements=((256, 0.5),), needle_bits=(2,), needle_fractions=(0.5,),
               joint=({"bitwidth.key_bits": 8, "bitwidth.value_bits": 2},))


@pytest.fixture(scope="module")
def runtime():
    from skistune.runtime.llm import Runtime

    return Runtime.from_preset("smollm2-135m", KVConfig().with_knobs({"offload.device_kv_bytes": SCORING_KV_BYTES}))


@pytest.fixture(scope="module")
def measured(runtime, tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "quality.json"
    seen = []
    profile = build_profile(runtime, TINY, path, progress=lambda label, done, total: seen.append((label, done, total)))
    return path, profile, seen


def test_the_profile_holds_every_measurement_and_its_provenance(measured):
    path, profile, seen = measured
    data = json.loads(path.read_text())
    assert len(data["perplexity"]) == len(TINY.perplexity(30)) and len(data["needle"]) == len(TINY.needle())
    assert data["corpus"]["window_tokens"] == 128 and data["protocol"]["grid"] == "tiny"
    assert all(len(e["nll"]) == 1 for e in data["perplexity"].values())
    assert seen[-1] == ("done", len(TINY.perplexity(30)) + len(TINY.needle()), len(seen) - 1)
    assert data["combination"] and data["combination"][0]["knobs"] == TINY.joint[0]


def test_a_second_run_resumes_and_measures_nothing(runtime, measured):
    path, profile, _ = measured
    seen, said = [], []
    again = build_profile(runtime, TINY, path, progress=lambda label, done, total: seen.append(total), note=said.append)
    assert seen == [0] and again.data["perplexity"] == profile.data["perplexity"]
    kept = len(TINY.perplexity(30)) + len(TINY.needle())
    assert said == [f"resuming {path}: {kept} measurements kept, 0 to take (--fresh measures everything again)"]


def test_fewer_bits_lose_more_and_the_full_cache_finds_the_passkey(measured):
    _, profile, _ = measured
    int8 = profile.predict(KVConfig().with_knobs({"bitwidth.key_bits": 8, "bitwidth.value_bits": 8}))
    int2 = profile.predict(KVConfig().with_knobs({"bitwidth.key_bits": 2, "bitwidth.value_bits": 2}))
    assert int2.ppl_mean > int8.ppl_mean + 0.05 and int8.ppl_mean < 0.05  # read on every position
    assert profile.data["needle"]["{}"]["found"] == [True]


def test_held_out_quality_of_the_reference_config_is_zero(runtime):
    full, int2 = measure_quality(runtime, [KVConfig(), KVConfig().with_knobs({"bitwidth.key_bits": 2})],
                                 windows=1, window_tokens=128, continuation=8)
    assert full == {"ppl_mean": 0.0, "ppl_worst": 0.0} and int2["ppl_mean"] > 0.01


def test_a_file_that_cannot_be_resumed_is_refused_not_overwritten(runtime, measured, tmp_path):
    """A quick run over a full profile (or a run on another Python: another corpus) wiped hours of measurements
    at its first one, in silence; so did a run over any other file."""
    path, _, _ = measured
    other = tmp_path / "other-grid.json"
    other.write_text(path.read_text().replace('"grid": "tiny"', '"grid": "full"'))
    before = other.read_text()
    with pytest.raises(ValueError, match=r"holds a quality profile measured with the full grid, not the tiny grid, so "
                                         r"its measurements cannot be resumed; .* pass --fresh"):
        build_profile(runtime, TINY, other, progress=lambda *a: pytest.fail("measured"))
    assert other.read_text() == before
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(ValueError, match=r"notes.txt: is not a quality profile \(not JSON\)"):
        build_profile(runtime, TINY, notes)
    assert notes.read_text() == "my notes\n"
