"""Each public trace format read from the real samples, checked against the figures in their SOURCE.md."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from skistune.workloads import detect_format, load_workload, read_trace, to_requests, workload_stats
from workload_paths import (ARXIV, AZURE_CODE, AZURE_CONV, AZURE_HEADER, BURSTGPT_1, BURSTGPT_3,
                                   BURSTGPT_HEADER, BWB, MOONCAKE_CONV, MOONCAKE_SYNTH, SHAREGPT)

# path, format, requests, duration_s, rate_rps, (input mean, p50, p99), (output mean, p50, p99): SOURCE.md
TIMED_SAMPLES = [
    (AZURE_CONV, "azure", 19366, 3501.7, 5.5304, (1155, 1020, 4142), (211, 129, 601)),
    (AZURE_CODE, "azure", 8819, 3435.9, 2.5667, (2048, 1469, 7436), (28, 13, 251)),
    (MOONCAKE_CONV, "mooncake", 7980, 2433.0, 3.2799, (12403, 7220, 89867), (347, 356, 1167)),
    (MOONCAKE_SYNTH, "mooncake", 3993, 1022.0, 3.9069, (15325, 11587, 66456), (149, 69, 768)),
]
LENGTH_SAMPLES = [
    (SHAREGPT, 30731, (2340, 1730, 7434), (439, 415, 998)),
    (ARXIV, 28257, (2588, 2730, 3933), (291, 167, 3271)),
    (BWB, 33768, (1067, 1037, 1800), (1613, 1601, 2533)),
]


def _assert_lengths(stats, inputs: tuple, outputs: tuple) -> None:
    got_in = (stats.input_mean, stats.input_p50, stats.input_p99)
    got_out = (stats.output_mean, stats.output_p50, stats.output_p99)
    # SOURCE.md rounds to whole tokens
    assert np.allclose(got_in, inputs, atol=0.51), (got_in, inputs)
    assert np.allclose(got_out, outputs, atol=0.51), (got_out, outputs)


@pytest.mark.parametrize("path, fmt, requests, duration_s, rate_rps, inputs, outputs", TIMED_SAMPLES,
                         ids=lambda v: v.parent.name if isinstance(v, Path) else None)
def test_timed_samples_match_source_statistics(path, fmt, requests, duration_s, rate_rps, inputs, outputs):
    assert detect_format(path) == fmt
    workload = read_trace(path)
    stats = workload_stats(workload)
    assert stats.requests == requests
    assert stats.duration_s == pytest.approx(duration_s, abs=0.05)
    assert stats.rate_rps == pytest.approx(rate_rps, abs=5e-5)
    _assert_lengths(stats, inputs, outputs)
    assert workload.arrival_s[0] == 0 and np.all(np.diff(workload.arrival_s) >= 0)


@pytest.mark.parametrize("path, requests, inputs, outputs", LENGTH_SAMPLES, ids=lambda v: getattr(v, "stem", None))
def test_length_only_samples_get_generated_arrivals(path, requests, inputs, outputs):
    assert detect_format(path) == "lengths"
    workload = read_trace(path)
    stats = workload_stats(workload)
    assert stats.requests == requests
    _assert_lengths(stats, inputs, outputs)
    assert workload.generated_arrivals
    assert stats.rate_rps == pytest.approx(1.0)  # the default arrival process: Poisson at 1 req/s
    assert stats.burstiness == pytest.approx(1.0, abs=0.05)
    assert any("arrivals generated" in note for note in workload.notes)


def test_length_only_arrival_process_is_chosen_and_seeded():
    fast = load_workload(str(SHAREGPT), rate_rps=8.0, burstiness=3.0, seed=4)
    stats = workload_stats(fast)
    assert stats.rate_rps == pytest.approx(8.0)
    assert stats.burstiness == pytest.approx(3.0, rel=0.15)
    assert load_workload(str(SHAREGPT), rate_rps=8.0, burstiness=3.0, seed=4).digest() == fast.digest()
    assert load_workload(str(SHAREGPT), rate_rps=8.0, burstiness=3.0, seed=5).digest() != fast.digest()


def test_mooncake_prefix_structure_is_kept():
    workload = read_trace(MOONCAKE_CONV)
    assert workload.block_tokens == 512
    assert len(workload.block_ids) == 197084  # SOURCE.md total_blocks
    assert len(np.unique(workload.block_ids)) == 128076  # SOURCE.md unique_blocks
    assert workload_stats(workload).prefix_reuse_ratio == pytest.approx(0.3501, abs=5e-5)
    assert list(workload.blocks(0)) == list(range(14))  # first line: hash_ids [0 .. 13]
    assert workload.blocks(1)[0] == 0  # the second request shares the first block (a common system prompt)
    assert workload_stats(read_trace(MOONCAKE_SYNTH)).prefix_reuse_ratio == pytest.approx(0.6396, abs=5e-5)


def test_mooncake_quantized_timestamps_are_noticed():
    workload = read_trace(MOONCAKE_CONV)
    assert any("steps of 3 s" in note for note in workload.notes)
    assert len(np.unique(workload.arrival_s)) == 812
    assert set(np.round(np.diff(np.unique(workload.arrival_s)), 3)) <= {2.999, 3.0, 3.001}  # SOURCE.md: 2999-3001 ms


def test_burstgpt_drops_failed_requests_and_reports_them():
    workload = read_trace(BURSTGPT_1)
    assert detect_format(BURSTGPT_1) == "burstgpt"
    assert len(workload) == 400 - 17  # SOURCE.md: 17 rows with 0 response tokens
    assert any("dropped 17 of 400 rows with 0 output tokens" in note for note in workload.notes)
    assert workload.output_tokens.min() >= 1
    assert len(workload.block_ids) == 0  # v1 has no sessions: every prompt is its own


def test_burstgpt_sessions_become_multi_turn_prompts():
    workload = read_trace(BURSTGPT_3)
    stats = workload_stats(workload)
    assert stats.requests == 399  # one failed row dropped
    assert stats.multi_turn_sessions == 76  # SOURCE.md sessions_with_2plus_turns
    assert stats.sessions == 135 + 5  # 135 sessions plus 5 API-log rows without a session id
    assert stats.prefix_reuse_ratio > 0.3
    requests = to_requests(workload, vocab_size=1000)
    extended = 0
    for session in np.unique(workload.session_ids):
        turns = np.flatnonzero(workload.session_ids == session)
        for earlier, later in zip(turns[:-1], turns[1:]):
            if workload.input_tokens[later] > workload.input_tokens[earlier]:
                shared = workload.input_tokens[earlier] // workload.block_tokens * workload.block_tokens
                prompt_a, prompt_b = requests[earlier].prompt_token_ids, requests[later].prompt_token_ids
                assert np.array_equal(prompt_a[:shared], prompt_b[:shared])
                extended += 1
    assert extended == 219  # SOURCE.md: request tokens rise in 219 of 259 consecutive same-session pairs


@pytest.mark.parametrize("path, fmt", [(AZURE_CONV, "azure"), (MOONCAKE_CONV, "mooncake"), (BURSTGPT_3, "burstgpt"),
                                       (BWB, "lengths")], ids=["azure", "mooncake", "burstgpt", "lengths"])
def test_detection_reads_content_not_the_file_name(write, path, fmt):
    head = "".join(path.read_text().splitlines(keepends=True)[:20])
    disguised = write("trace.txt" if fmt == "mooncake" else "trace.jsonl", head)
    assert detect_format(disguised) == fmt
    assert len(read_trace(disguised)) > 0


def test_format_can_be_forced(write):
    path = write("trace.csv", AZURE_HEADER + "2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.18,10,5\n")
    assert len(read_trace(path, format="azure")) == 2
    with pytest.raises(ValueError, match=r"trace\.csv:1: column Timestamp: missing from the header"):
        read_trace(path, format="burstgpt")


def test_gzip_traces_are_read(tmp_path):
    path = tmp_path / "trace.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(BURSTGPT_HEADER + "5,ChatGPT,472,18,490,Conversation log\n45,GPT-4,1087,230,1317,API log\n")
    workload = read_trace(path)
    assert list(workload.input_tokens) == [472, 1087] and list(workload.arrival_s) == [0.0, 40.0]


def test_quoted_csv_takes_the_careful_path(write):
    path = write("quoted.csv", BURSTGPT_HEADER + '5,"ChatGPT",472,18,490,"Conversation, log"\n')
    assert list(read_trace(path).output_tokens) == [18]


def test_request_ids_are_file_rows_kept_through_sorting(write):
    rows = "2023-11-16 18:00:02,10,5\n2023-11-16 18:00:01,20,6\n2023-11-16 18:00:03,30,7\n"
    path = write("t.csv", AZURE_HEADER + rows)
    workload = read_trace(path)
    assert list(workload.request_ids) == [1, 0, 2]
    assert list(workload.input_tokens) == [20, 10, 30]
