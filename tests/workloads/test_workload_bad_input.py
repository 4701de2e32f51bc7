"""Bad input: one clear line naming file, line and column; exit code 2 through the CLI; no traceback."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.workloads import load_workload, read_trace
from workload_paths import AZURE_CONV, AZURE_HEADER, BURSTGPT_HEADER

GOOD_ROW = "2023-11-16 18:15:46.68,374,44\n"
MOONCAKE_ROW = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n'

# file name, content, expected error (after "PATH")
BAD_FILES = [
    ("not_int.csv", AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:47.68,abc,44\n",
     ":3: column ContextTokens: 'abc' is not an integer"),
    ("negative.csv", AZURE_HEADER + GOOD_ROW + GOOD_ROW + "2023-11-16 18:15:48.68,12,-5\n",
     ":4: column GeneratedTokens: negative length -5"),
    ("short_row.csv", AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:46.68,374\n",
     ":3: column GeneratedTokens: missing (row has 2 of 3 fields)"),
    ("extra_field.csv", AZURE_HEADER + "2023-11-16 18:15:46.68,374,44,9\n" + GOOD_ROW,
     ":2: column 4: unexpected extra field '9'"),
    ("bad_time.csv", BURSTGPT_HEADER + "5,ChatGPT,472,18,490,Conversation log\nsoon,ChatGPT,1,1,2,API log\n",
     ":3: column Timestamp: 'soon' is not a time in seconds"),
    ("bad_date.csv", AZURE_HEADER + GOOD_ROW + "yesterday,1,1\n",
     ":3: column TIMESTAMP: 'yesterday' is not a date-time"),
    ("float_len.csv", "num_prefill_tokens,num_decode_tokens\n10,5\n12.5,3\n",
     ":3: column num_prefill_tokens: '12.5' is not an integer"),
    ("broken.jsonl", MOONCAKE_ROW + '{"timestamp": 3000, "input_length": 5, "output_length": 3\n',
     ":2: character 58: not valid JSON (Expecting ',' delimiter)"),
    ("negative.jsonl", MOONCAKE_ROW + '{"timestamp": 3000, "input_length": -7, "output_length": 3}\n',
     ":2: column input_length: negative length -7"),
    ("missing_key.jsonl", MOONCAKE_ROW + '{"timestamp": 3000, "input_length": 7}\n',
     ":2: column output_length: missing"),
    # lengths above MAX_TOKENS (2^63-1 passed, then wrapped to negative counts) and absurd timestamps
    ("huge_output.csv", AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:47.68,200,9223372036854775807\n",
     ":3: column GeneratedTokens: length 9223372036854775807 is above 10,000,000 tokens, which no model's "
     "context holds"),
    ("huge_input.jsonl", MOONCAKE_ROW + '{"timestamp": 1, "input_length": 10000001, "output_length": 3}\n',
     ":2: column input_length: length 10000001 is above 10,000,000 tokens, which no model's context holds"),
    ("huge_time.csv", BURSTGPT_HEADER + "1e300,ChatGPT,100,10,110,API log\n1,ChatGPT,100,10,110,API log\n",
     ":2: column Timestamp: '1e300' is beyond 1e+11 s (3,000 years): not a time in seconds"),
    ("huge_time.jsonl", MOONCAKE_ROW + '{"timestamp": 1e15, "input_length": 7, "output_length": 3}\n',
     ":2: column timestamp: 1e+15 is beyond 1e+14 ms (3,000 years): not a time in milliseconds"),
    ("too_many_blocks.jsonl",
     MOONCAKE_ROW + '{"timestamp": 1, "input_length": 7, "output_length": 3, "hash_ids": [0, 1]}\n',
     ":2: column hash_ids: 2 blocks of 512 tokens are more than input_length 7 holds"),
]
EMPTY_FILES = [
    ("zero_bytes.csv", ""),
    ("header_only.csv", AZURE_HEADER),
    ("blank_lines.jsonl", "\n\n"),
    ("all_failed.csv", BURSTGPT_HEADER + "5,ChatGPT,472,0,472,Conversation log\n"),
    ("lengths_header_only.csv", "num_prefill_tokens,num_decode_tokens\n"),  # (was "arrivals need n >= 1")
]


def _cli(*args: str):
    return CliRunner().invoke(app, ["workload", "show", *args])


def _assert_one_line_error(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert expected in lines[0]


@pytest.mark.parametrize("name, text, expected", BAD_FILES, ids=[case[0] for case in BAD_FILES])
def test_malformed_row_names_file_line_and_column(write, name, text, expected):
    path = write(name, text)
    with pytest.raises(ValueError) as error:
        read_trace(path)
    assert str(error.value) == f"{path}{expected}"
    _assert_one_line_error(_cli(str(path)), f"{path}{expected}")


@pytest.mark.parametrize("name, text, expected", BAD_FILES, ids=[case[0] for case in BAD_FILES])
def test_skip_bad_rows_skips_and_counts(write, name, text, expected):
    path = write(name, text)
    workload = read_trace(path, skip_bad_rows=True)
    assert len(workload) >= 1
    assert any(note.startswith("skipped 1 bad row (first: ") and expected in note for note in workload.notes)
    result = _cli(str(path), "--skip-bad-rows", "--json")
    assert result.exit_code == 0, result.output
    assert "skipped 1 bad row" in result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["requests"] == len(workload)


def test_skip_bad_rows_counts_every_bad_row(write):
    rows = [GOOD_ROW, "x,1,1\n", GOOD_ROW.replace("374", "-1"), GOOD_ROW, "2023-11-16 18:15:49,1\n"]
    workload = read_trace(write("many.csv", AZURE_HEADER + "".join(rows)), skip_bad_rows=True)
    assert len(workload) == 2
    assert any(note.startswith("skipped 3 bad rows") for note in workload.notes)


@pytest.mark.parametrize("name, text", EMPTY_FILES, ids=[case[0] for case in EMPTY_FILES])
def test_empty_trace_is_an_error(write, name, text):
    path = write(name, text)
    with pytest.raises(ValueError, match="empty trace"):
        read_trace(path, format="burstgpt" if name == "all_failed.csv" else None)
    _assert_one_line_error(_cli(str(path)), f"{path}: empty trace")


def test_only_bad_rows_is_an_empty_trace(write):
    path = write("all_bad.csv", AZURE_HEADER + "x,1,1\n")
    with pytest.raises(ValueError, match=r"empty trace \(no rows; 1 bad skipped\)"):
        read_trace(path, skip_bad_rows=True)


def test_non_monotonic_timestamps_are_sorted_with_a_note(write):
    path = write("unsorted.csv", BURSTGPT_HEADER + "10,ChatGPT,5,3,8,Conversation log\n4,ChatGPT,6,3,9,API log\n"
                 "7,GPT-4,7,2,9,API log\n12,GPT-4,8,2,10,API log\n")
    workload = read_trace(path)
    assert list(workload.arrival_s) == [0.0, 3.0, 6.0, 8.0]
    assert list(workload.input_tokens) == [6, 7, 5, 8]
    assert "timestamps not in order (1 step back in time): sorted by arrival" in workload.notes
    result = _cli(str(path))
    assert result.exit_code == 0 and "sorted by arrival" in result.stderr


def test_unknown_format_is_an_error(write):
    path = write("other.csv", "a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match=r"other\.csv: unknown trace format \(first line 'a,b,c'\)"):
        read_trace(path)
    _assert_one_line_error(_cli(str(path)), "unknown trace format")
    _assert_one_line_error(_cli(str(path), "--format", "parquet"), "format 'parquet': unknown")
    json_path = write("other.jsonl", '{"prompt": "hi"}\n')
    _assert_one_line_error(_cli(str(json_path)), "unknown trace format")


def test_format_with_a_preset_says_format_is_for_trace_files():
    """It said "neither a preset (chat, ...) nor an existing file" of chat, a preset."""
    _assert_one_line_error(_cli("chat", "--format", "mooncake"),
                           "workload 'chat' is a preset: --format applies to trace files; write ./chat for a file "
                           "of that name (in Python: format=)")
    with pytest.raises(ValueError, match="is a preset: --format"):
        load_workload("chat", format="mooncake")


@pytest.mark.parametrize("workload", ["chat", str(AZURE_CONV), "no-such-preset"])
def test_unknown_format_is_named_whatever_the_workload(workload):
    _assert_one_line_error(_cli(workload, "--format", "parquet"),
                           "--format 'parquet': unknown (known: azure, mooncake, burstgpt, lengths)")


def test_a_directory_is_called_one_and_its_trace_files_named(tmp_path):
    """A folder of traces was "neither a preset ... nor an existing file"."""
    _assert_one_line_error(_cli(str(AZURE_CONV.parent)),
                           f"workload '{AZURE_CONV.parent}': a directory, neither a preset (chat, code, "
                           f"long-context, agent) nor a trace file; name a trace file in it: {AZURE_CONV}")
    for name in ("a.csv", "b.jsonl", "c.csv.gz", "d.csv"):
        (tmp_path / name).write_text("")
    _assert_one_line_error(_cli(str(tmp_path)), "a directory, neither a preset")
    with pytest.raises(ValueError, match=r"a directory, .* nor a trace file; it holds 4 trace-like files: name one$"):
        load_workload(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"a directory, neither a preset \(.*\) nor a trace file$"):
        load_workload(empty)


def test_unknown_workload_and_misplaced_options(write):
    _assert_one_line_error(_cli("no-such-preset"),
                           "neither a preset (chat, code, long-context, agent) nor an existing file")
    path = write("t.csv", AZURE_HEADER + GOOD_ROW + GOOD_ROW)
    _assert_one_line_error(_cli(str(path), "--requests", "5"), "requests applies to presets")
    _assert_one_line_error(_cli(str(path), "--burstiness", "2"), "--burstiness applies to generated arrivals")
    _assert_one_line_error(_cli("chat", "--window", "abc"), "expected START:END")
    _assert_one_line_error(_cli("chat", "--window", "900:1000"), "no request arrives in 900:1000 s")
    _assert_one_line_error(_cli("chat", "--rate-scale", "0"), "rate scale must be > 0")
    with pytest.raises(ValueError, match="length scale must be > 0"):
        load_workload("chat", requests=10, length_scale=-1)


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_every_rate_option_refuses_non_finite_and_non_positive_values_by_the_name_typed(write, value):
    """--rate inf used to put every arrival at 0 (a preset) or blame "rate scale" (a trace), and --rate nan
    blamed the arrivals: each rate option now says what was typed, on a preset and on a trace alike."""
    trace = write("t.csv", AZURE_HEADER + GOOD_ROW + "2023-11-16 18:15:47.68,374,44\n")
    for workload in ("chat", str(trace)):
        _assert_one_line_error(_cli(workload, "--rate", value),
                               f"Invalid value for '--rate': rate (req/s) must be > 0 and finite, got {float(value)}")
        _assert_one_line_error(_cli(workload, "--rate-scale", value),
                               f"Invalid value for '--rate-scale': rate scale must be > 0 and finite, got {float(value)}")


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_length_scale_is_refused_like_the_other_options_by_the_name_typed(value):
    """--length-scale 0 failed later, in the transform, without the ``Invalid value for`` prefix and the help
    pointer that --rate-scale 0 or --requests 0 get."""
    result = _cli("chat", "--requests", "5", "--length-scale", value)
    _assert_one_line_error(result, f"Invalid value for '--length-scale': length scale must be > 0 and finite, "
                                   f"got {float(value)} (see skistune workload show --help)")


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate_rps=float("inf")), "rate_rps must be > 0 and finite, got inf"),
    (dict(rate_rps=float("nan")), "rate_rps must be > 0 and finite, got nan"),
    (dict(rate_rps=0), "rate_rps must be > 0 and finite, got 0"),
    (dict(rate_scale=float("inf")), "rate_scale must be > 0 and finite, got inf"),
    (dict(rate_scale=-2.0), "rate_scale must be > 0 and finite, got -2.0"),
])
def test_load_workload_names_the_rate_keyword_it_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_workload("chat", requests=5, **kwargs)


def test_set_rate_refuses_an_infinite_rate_as_a_rate():
    from skistune.workloads import set_rate

    timed = load_workload("chat", requests=5)
    with pytest.raises(ValueError, match="rate must be > 0 and finite"):
        set_rate(timed, float("inf"))


def test_a_backwards_window_names_the_option():
    """'time window needs 0 <= start < end' had not said which option was wrong."""
    from skistune.workloads import load_workload

    with pytest.raises(ValueError, match=r"^--window 5:2: a time window needs 0 <= start < end \(seconds of the trace\)$"):
        load_workload("chat", requests=50, window_s=(5.0, 2.0))
