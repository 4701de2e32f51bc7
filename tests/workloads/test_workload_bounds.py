"""Bounds a tester found missing or unclear: a burstiness the requests cannot draw (noted), lengths past any model's
context, timestamps past any trace's, messages that named `--rate (rate_rps=)`, JSON positions called
columns, and --first/--sample past the end kept without a word."""
from __future__ import annotations

import re

import pytest

from skistune.workloads import Workload, load_workload, read_trace, synthesize
from skistune.workloads.load import MAX_TOKENS as LOAD_MAX_TOKENS
from skistune.workloads.model import MAX_TOKENS
from skistune.workloads.readers import MAX_SPAN_S
from skistune.workloads.synthetic import min_requests
from show_cli import one_line_error, run_show
from workload_paths import (AZURE_CODE, AZURE_CONV, AZURE_HEADER, BURSTGPT_1, BURSTGPT_3, BURSTGPT_HEADER,
                            MOONCAKE_CONV, MOONCAKE_SYNTH)

LENGTHS_HEADER = "num_prefill_tokens,num_decode_tokens\n"


# ---- 1. a draw far below the burstiness asked for is noted, with the requests it would need ----

@pytest.mark.parametrize("burstiness, needed", [("50", "10,003"), ("100", "40,003")])
def test_a_burstiness_whose_idle_gaps_the_requests_would_miss_is_noted_with_what_it_needs(burstiness, needed):
    """--burstiness 50 and 100 at 2,000 requests came out Poisson (CV 1.009), with nothing said. (Not refused: a
    benchmark replays 12 requests at 4, which no 11 gaps can draw either.)"""
    result = run_show("chat", "--requests", "2000", "--burstiness", burstiness)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0 and f"under half the {burstiness} asked for" in said
    assert "(no 1,999 gaps can have a CV above 44.70)" in said and f"use at least {needed} requests" in said


def test_the_requests_a_burstiness_needs():
    assert min_requests(13.2) == 700 and min_requests(2.0) == 1  # (Gamma gaps need no idle ones)
    assert min_requests(50) == 10_003


def test_a_length_only_trace_too_short_for_its_burstiness_is_noted(write):
    path = write("lengths.csv", LENGTHS_HEADER + "10,5\n" * 30)
    workload = load_workload(path, burstiness=5.0, seed=2)  # (CV 0.84; seed 0 drew an idle gap: 2.6)
    assert len(workload) == 30 and any("use at least 103 requests" in n for n in workload.notes)


def test_a_realised_burstiness_under_half_the_requested_is_noted():
    """The table showed "requested 100.00" beside "realised 1.01" and no note; a preset's own burstiness is kept
    at any size (code at 300 requests, whose seed 5 drew no idle gap), so it gets the note."""
    workload = synthesize("code", requests=300, seed=5)
    note = ("burstiness (CV of gaps) 1.02 as generated, under half the 13.2 asked for: a CV that high comes from "
            "idle gaps, one in about 349, and these 299 gaps drew too few; use at least 700 requests, or another seed")
    assert note in workload.notes
    result = run_show("code", "--requests", "300", "--seed", "5")
    assert result.exit_code == 0 and f"note: code: {note}" in " ".join(result.stderr.split())
    assert synthesize("code", requests=300, seed=3).notes == ()  # (CV 9.0: a draw with idle gaps)
    assert len(synthesize("code", requests=16)) == 16  # (a preset's own burstiness is never refused)
    assert not any("burstiness" in n for n in synthesize("code", requests=2000, seed=0).notes)
    assert not any("burstiness" in n for n in synthesize("chat", requests=2000, seed=0, burstiness=3.0).notes)


def test_a_length_only_trace_gets_the_note_too(write):
    path = write("lengths.csv", LENGTHS_HEADER + "10,5\n" * 40)  # (40 requests: CV 3 needs 39)
    assert "burstiness (CV of gaps) 1.15 as generated, under half the 3 asked for: a CV that high comes from idle " \
           "gaps, one in about 19, and these 39 gaps drew too few; use more requests, or another seed" \
           in load_workload(path, burstiness=3.0, seed=0).notes
    assert not any("burstiness (CV" in n for n in load_workload(path, burstiness=3.0, seed=1).notes)  # (2.45)


# ---- 2. lengths past any model's context ----

def test_one_token_bound_is_shared_by_readers_and_length_scale():
    assert LOAD_MAX_TOKENS is MAX_TOKENS == 10_000_000


@pytest.mark.parametrize("name, text, where", [
    ("az.csv", AZURE_HEADER + "2023-11-16 18:15:46.68,100000000000,10\n"
               "2023-11-16 18:15:47.68,200,9223372036854775807\n", ":2: column ContextTokens: length 100000000000"),
    ("bg.csv", BURSTGPT_HEADER + "5,ChatGPT,472,18,490,API log\n6,ChatGPT,4,10000001,490,API log\n",
     ":3: column Response tokens: length 10000001"),
    ("mc.jsonl", '{"timestamp": 0, "input_length": 6, "output_length": 3}\n'
                 '{"timestamp": 1, "input_length": 6, "output_length": 9223372036854775807}\n',
     ":2: column output_length: length 9223372036854775807"),
    ("len.csv", LENGTHS_HEADER + "10,5\n10000001,3\n", ":3: column num_prefill_tokens: length 10000001"),
])
def test_every_reader_refuses_a_length_above_the_bound_by_file_line_and_column(write, name, text, where):
    """2^63-1 output tokens was accepted: --max-output then said "every request needs >= 1 output token"."""
    path = write(name, text)
    expected = f"{path}{where} is above 10,000,000 tokens, which no model's context holds"
    with pytest.raises(ValueError) as error:
        read_trace(path)
    assert str(error.value) == expected
    one_line_error(run_show(str(path), "--max-output", "100"), expected)


def test_a_length_at_the_bound_is_kept(write):
    path = write("len.csv", LENGTHS_HEADER + f"{MAX_TOKENS},{MAX_TOKENS}\n5,5\n")
    assert int(read_trace(path).input_tokens.max()) == MAX_TOKENS


def test_a_workload_refuses_a_request_above_the_bound():
    with pytest.raises(ValueError, match=r"a request of 10,000,001 tokens is above 10,000,000"):
        Workload.from_lengths("w", [0.0], [10_000_001], [1])


# ---- 3. timestamps past any trace's ----

def test_a_timestamp_past_the_bound_is_refused_by_line(write):
    """1e300 gave float-rounded, 300-digit durations."""
    path = write("bg.csv", "Timestamp,Model,Request tokens,Response tokens\n1e300,ChatGPT,100,10\n1,ChatGPT,100,10\n")
    one_line_error(run_show(str(path)), f"{path}:2: column Timestamp: '1e300' is beyond 1e+11 s")
    assert len(read_trace(path, skip_bad_rows=True)) == 1


@pytest.mark.parametrize("name, text, column", [
    ("bg.csv", BURSTGPT_HEADER + "3e9,ChatGPT,100,10,110,API log\n1,ChatGPT,100,10,110,API log\n", "Timestamp"),
    ("az.csv", AZURE_HEADER + "1700-11-16 18:15:46.68,100,10\n2023-11-16 18:15:47.68,200,9\n", "TIMESTAMP"),
    ("mc.jsonl", '{"timestamp": 0, "input_length": 6, "output_length": 3}\n'
                 '{"timestamp": 4e11, "input_length": 6, "output_length": 3}\n', "timestamp"),
])
def test_timestamps_spanning_more_than_ten_years_are_refused(write, name, text, column):
    path = write(name, text)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: column {column}: the timestamps span .* years\), "
                                         r"more than any serving trace \(10 years at most\)"):
        read_trace(path)


def test_epoch_seconds_pass_with_their_milliseconds(write):
    path = write("bg.csv", BURSTGPT_HEADER + "1700000000.125,ChatGPT,100,10,110,API log\n"
                                             "1700000000.25,ChatGPT,100,10,110,API log\n")
    assert list(read_trace(path).arrival_s) == [0.0, 0.125]


@pytest.mark.parametrize("path", [AZURE_CONV, AZURE_CODE, MOONCAKE_CONV, MOONCAKE_SYNTH, BURSTGPT_1, BURSTGPT_3],
                         ids=lambda p: p.parent.name)
def test_every_real_trace_sample_is_far_inside_the_time_bounds(path):
    """Read at all, each row passed `MAX_TIMESTAMP_S`; and each spans under a thousandth of `MAX_SPAN_S`."""
    assert read_trace(path).duration_s < MAX_SPAN_S / 1000


# ---- 4. messages name the option, then the Python keyword, once each ----

@pytest.mark.parametrize("args, kwargs, message, keyword", [
    (["chat", "--rate", "1e-300"], dict(rate_rps=1e-300),
     "--rate 1e-300 req/s: below 1e-06 req/s (a mean gap over 11 days), which is no service's load", "rate_rps"),
    (["chat", "--length-scale", "2000"], dict(length_scale=2000),
     "--length-scale 2000: makes the longest request", "length_scale"),
    (["chat", "--format", "azure"], dict(format="azure"),
     "workload 'chat' is a preset: --format applies to trace files; write ./chat for a file of that name", "format"),
    ([str(AZURE_CONV), "--burstiness", "2"], dict(burstiness=2.0),
     "--burstiness applies to generated arrivals (presets, length-only traces); this trace has its own timestamps",
     "burstiness"),
    (["chat", "--rate", "1000", "--rate-scale", "1e4"], dict(rate_rps=1000, rate_scale=1e4),
     "--rate-scale 10000: gives 1e+07 req/s, above 1e+06 req/s", "rate_scale"),
])
def test_messages_read_option_value_then_the_python_keyword(args, kwargs, message, keyword):
    """They read `--rate (rate_rps=) 1e-300 req/s`: both names before the value, the keyword bare."""
    one_line_error(run_show(*args), message)
    with pytest.raises(ValueError) as error:
        load_workload(args[0], **kwargs)
    text = str(error.value)
    assert message in text and text.endswith(f" (in Python: {keyword}=)") and re.search(r"\(\w+=\)", text) is None


# ---- 5. JSON positions are characters; columns are fields ----

def test_a_csv_read_as_mooncake_names_the_character_not_a_column(write):
    path = write("t.csv", AZURE_HEADER + "2023-11-16 18:15:46.68,374,44\n")
    one_line_error(run_show(str(path), "--format", "mooncake"),
                   f"{path}:1: character 1: not valid JSON (Expecting value)")


def test_an_integer_past_pythons_digit_limit_is_a_bad_row_not_a_crash(write):
    path = write("big.jsonl", '{"timestamp": 0, "input_length": 6, "output_length": 3}\n'
                              '{"timestamp": 1, "input_length": 1' + "0" * 5000 + ', "output_length": 3}\n'
                              '{"timestamp": 1' + "0" * 400 + ', "input_length": 6, "output_length": 3}\n')
    with pytest.raises(ValueError, match=r":2: not valid JSON \(a number of over 4,300 digits\)$"):
        read_trace(path)
    workload = read_trace(path, skip_bad_rows=True)
    assert "skipped 2 bad rows" in workload.notes[-1] and len(workload) == 1
    path = write("big2.jsonl", '{"timestamp": 1' + "0" * 400 + ', "input_length": 6, "output_length": 3}\n')
    with pytest.raises(ValueError, match=r":1: column timestamp: ~1e\+400 is beyond 1e\+14 ms"):
        read_trace(path)


def test_a_csv_length_past_pythons_digit_limit_is_a_length_and_a_bad_value_is_echoed_in_short(write):
    """A 5,000-digit length read "is not an integer", echoing all 5,000 digits."""
    path = write("big.csv", LENGTHS_HEADER + "9" * 5000 + ",5\n10,5\n")
    with pytest.raises(ValueError) as err:
        read_trace(path)
    assert str(err.value) == (f"{path}:2: column num_prefill_tokens: length of 5,000 digits is above 10,000,000 "
                              "tokens, which no model's context holds")
    path = write("bad.csv", LENGTHS_HEADER + "x" * 5000 + ",5\n10,5\n")
    with pytest.raises(ValueError, match=r":2: column num_prefill_tokens: 'x{40}'\.\.\. is not an integer$"):
        read_trace(path)


# ---- 6. --first/--sample past the end say what they kept ----

@pytest.mark.parametrize("option", ["--first", "--sample"])
def test_first_or_sample_past_the_end_notes_what_was_kept(option):
    """`chat --requests 50 --sample 100` kept 50, which only the transforms row told."""
    result = run_show("chat", "--requests", "50", option, "100")
    assert result.exit_code == 0, result.output
    assert f"note: chat: {option[2:]} 100: the workload has only 50 requests, all kept" in result.stderr
    exact = load_workload("chat", requests=50, **{option[2:]: 50})
    assert not any("all kept" in n for n in exact.notes)
