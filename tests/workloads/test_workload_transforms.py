"""Transformations: rate and length scaling, sampling, windows, jitter, and `load_workload`'s order."""
from __future__ import annotations

import numpy as np
import pytest

from skistune.workloads import (Workload, first_n, jitter, load_workload, read_trace, sample_n, scale_lengths,
                                scale_rate, set_rate, synthesize, time_window, workload_stats)
from workload_paths import AZURE_CONV, MOONCAKE_CONV


@pytest.fixture(scope="module")
def conv():
    return read_trace(AZURE_CONV)


@pytest.fixture(scope="module")
def mooncake():
    return read_trace(MOONCAKE_CONV)


def test_scale_rate_and_set_rate(conv):
    doubled = scale_rate(conv, 2.0)
    assert np.allclose(doubled.arrival_s, conv.arrival_s / 2)
    assert workload_stats(doubled).rate_rps == pytest.approx(2 * 5.5304, abs=1e-3)
    assert doubled.transforms == ("rate x2",)
    assert workload_stats(set_rate(conv, 1.0)).rate_rps == pytest.approx(1.0)
    assert np.array_equal(doubled.input_tokens, conv.input_tokens)


def test_scale_lengths_with_caps(conv):
    small = scale_lengths(conv, 0.1, max_input=256, max_output=32)
    assert small.input_tokens.max() == 256 and small.output_tokens.max() == 32
    assert small.input_tokens.min() >= 1 and small.output_tokens.min() >= 1
    assert small.input_tokens[0] == min(256, round(conv.input_tokens[0] * 0.1))
    assert small.transforms == ("lengths x0.1, input <= 256, output <= 32",)
    assert scale_lengths(conv, 1.0, max_output=32).transforms == ("output <= 32",)  # (no "lengths x1")


def test_scaling_mooncake_keeps_its_prefix_reuse(mooncake):
    small = scale_lengths(mooncake, 1 / 32)  # 512-token blocks become 16-token blocks
    assert small.block_tokens == 16
    for i in range(0, len(small), 97):  # each prompt keeps a leading run of its blocks
        assert np.array_equal(small.blocks(i), mooncake.blocks(i)[:len(small.blocks(i))])
    assert len(small.block_ids) > 0.998 * len(mooncake.block_ids)  # only last blocks rounded to 0 tokens go
    assert workload_stats(small).prefix_reuse_ratio == pytest.approx(0.3501, abs=0.01)


def test_scaling_below_one_token_merges_blocks():
    workload = synthesize("long-context", requests=300, seed=0)  # 16-token blocks
    tiny = scale_lengths(workload, 1 / 64)  # a quarter token per block: groups of 4 merge
    assert tiny.block_tokens == 1
    counts = np.diff(tiny.block_offsets)
    assert np.all(counts <= tiny.input_tokens)
    reuse = workload_stats(workload).prefix_reuse_ratio
    assert workload_stats(tiny).prefix_reuse_ratio == pytest.approx(reuse, abs=0.03)
    merged = tiny.blocks(int(np.argmax(counts)))
    original = workload.blocks(int(np.argmax(counts)))
    assert np.array_equal(merged[:3], original[[3, 7, 11]])  # a group is named by its last block


def test_caps_keep_the_prefix(mooncake):
    capped = scale_lengths(mooncake, max_input=1024)
    assert capped.input_tokens.max() == 1024
    assert np.diff(capped.block_offsets).max() == 2
    assert np.array_equal(capped.blocks(5), mooncake.blocks(5)[:2])


def test_first_and_sample(conv):
    head = first_n(conv, 100)
    assert len(head) == 100 and np.array_equal(head.request_ids, np.arange(100))
    sampled = sample_n(conv, 500, seed=3)
    assert len(sampled) == 500 and np.all(np.diff(sampled.request_ids) > 0)
    assert sampled.arrival_s[0] == 0 and np.all(np.diff(sampled.arrival_s) >= 0)
    assert np.array_equal(sample_n(conv, 500, seed=3).request_ids, sampled.request_ids)
    assert not np.array_equal(sample_n(conv, 500, seed=4).request_ids, sampled.request_ids)
    assert len(first_n(conv, 10**6)) == len(conv)


def test_time_window(conv):
    window = time_window(conv, 600.0, 1200.0)
    original = conv.arrival_s[(conv.arrival_s >= 600) & (conv.arrival_s < 1200)]
    assert len(window) == len(original)
    assert np.allclose(window.arrival_s, original - 600.0)
    with pytest.raises(ValueError, match="start < end"):
        time_window(conv, 5.0, 5.0)


def test_jitter_spreads_steps_and_keeps_order(mooncake):
    spread = jitter(mooncake, 3.0, seed=0)
    assert np.array_equal(spread.request_ids, mooncake.request_ids)  # order kept within each 3-s step
    offsets = spread.arrival_s - mooncake.arrival_s
    assert offsets.min() >= 0 and offsets.max() < 3.0
    assert workload_stats(spread).burstiness == pytest.approx(1.0, abs=0.1)  # Poisson-like within steps
    assert len(np.unique(spread.arrival_s)) == len(spread)
    assert jitter(mooncake, 3.0, seed=0).digest() == spread.digest() != jitter(mooncake, 3.0, seed=1).digest()
    # the reader's advice to jitter is dropped once taken
    assert any("--jitter 3" in n for n in mooncake.notes) and not any("--jitter" in n for n in spread.notes)


@pytest.mark.parametrize("source, step_s", [(AZURE_CONV, 1.0), (AZURE_CONV, 0.001), ("chat", 1.0),
                                             (MOONCAKE_CONV, 10.0)])
def test_jitter_off_the_step_grid_re_sorts_arrivals(source, step_s):
    """Arrivals not on the step grid (Azure's milliseconds, a preset's, Mooncake's 3-s steps under a 10-s jitter)
    overtake each other: the jittered workload was refused ("arrival_s must be finite, >= 0 and sorted")."""
    original = load_workload(source)
    spread = load_workload(source, jitter_s=step_s)
    assert np.all(np.diff(spread.arrival_s) >= 0) and spread.arrival_s[0] >= 0
    assert sorted(spread.request_ids) == sorted(original.request_ids)
    # each request moved into [t, t + step) of its own time t, and kept its lengths
    by_id = np.argsort(original.request_ids)[np.searchsorted(np.sort(original.request_ids), spread.request_ids)]
    offsets = spread.arrival_s - original.arrival_s[by_id]
    assert offsets.min() >= 0 and offsets.max() < step_s
    assert np.array_equal(spread.input_tokens, original.input_tokens[by_id])
    for i in range(0, len(spread), 397):
        assert np.array_equal(spread.blocks(i), original.blocks(int(by_id[i])))
    assert load_workload(source, jitter_s=step_s).digest() == spread.digest()  # seeded
    assert load_workload(source, jitter_s=step_s, seed=1).digest() != spread.digest()


def test_take_keeps_blocks_with_their_requests(mooncake):
    index = np.array([5, 2, 9])
    taken = mooncake.take(index)
    for k, i in enumerate(index):
        assert np.array_equal(taken.blocks(k), mooncake.blocks(i))


def test_load_workload_applies_transforms_in_order():
    workload = load_workload(str(MOONCAKE_CONV), jitter_s=3.0, window_s=(0.0, 1200.0), first=2000, sample=1000,
                             length_scale=1 / 32, max_input=2048, max_output=128, rate_scale=2.0, seed=1)
    assert workload.transforms == ("jitter 3 s seed 1", "window 0:1200 s", "first 2000", "sample 1000 seed 1",
                                   "lengths x0.03125, input <= 2048, output <= 128", "rate x2")
    assert len(workload) == 1000 and workload.input_tokens.max() <= 2048 and workload.output_tokens.max() <= 128


def test_load_workload_rate_for_traces_and_presets(conv):
    assert workload_stats(load_workload(str(AZURE_CONV), rate_rps=2.0)).rate_rps == pytest.approx(2.0)
    preset = load_workload("chat", requests=200, rate_rps=2.0, rate_scale=3.0)
    assert workload_stats(preset).rate_rps == pytest.approx(6.0)
    assert load_workload(conv) is conv


def test_workload_arrays_are_read_only_views():
    arrival_s = np.array([0.0, 1.0])
    workload = Workload.from_lengths("two", arrival_s, np.array([3, 4]), np.array([1, 2]))
    assert arrival_s.flags.writeable and not workload.arrival_s.flags.writeable
    assert len(workload) == 2 and len(workload.blocks(1)) == 0
    with pytest.raises(ValueError, match="sorted"):
        Workload.from_lengths("bad", np.array([1.0, 0.0]), np.array([3, 4]), np.array([1, 2]))


def test_digest_is_stable_and_content_based(conv):
    assert read_trace(AZURE_CONV).digest() == conv.digest()
    assert first_n(conv, 10).digest() != conv.digest()
    assert len(conv.digest()) == 16


def test_sampling_generated_bursty_arrivals_says_it_thinned_them():
    """A tester's `code --sample 200` had CV 3.50 against 13.2 asked for, with no note (`--requests 200` says when a
    draw falls short)."""
    sampled = sample_n(synthesize("code", requests=2000, seed=0), 200, seed=0)
    assert any("after sampling 200 of 2,000 generated arrivals, against the 13.2 asked for" in n for n in sampled.notes)
    calm = sample_n(synthesize("long-context", requests=2000, seed=0), 200, seed=0)  # (Poisson stays Poisson)
    assert not any("after sampling" in n for n in calm.notes)
