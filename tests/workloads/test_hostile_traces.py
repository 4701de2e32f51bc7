"""Hostile trace files: a gzip header followed by random bytes (zlib.error had escaped as a traceback, exit 1),
and JSON lines nested past the parser's recursion (RecursionError). Each is one line naming the file."""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.workloads import detect_format, read_trace

GZIP_HEADER = b"\x1f\x8b\x08\x00"


def _corrupt_gzip(path: Path, seed: int) -> Path:
    """A gzip header, then bytes that do not inflate (seeds checked to raise zlib.error, not a bad header)."""
    path.write_bytes(GZIP_HEADER + bytes([0] * 6) + random.Random(seed).randbytes(200))
    return path


def _mooncake_line(**extra) -> str:
    return json.dumps({"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1], **extra})


@pytest.mark.parametrize("seed", range(4))
def test_a_gzip_of_random_bytes_is_a_damaged_gzip_file(tmp_path: Path, seed: int):
    path = _corrupt_gzip(tmp_path / "g.jsonl", seed)
    with pytest.raises(ValueError, match=rf"^{path}: damaged gzip file \("):
        read_trace(path)
    with pytest.raises(ValueError, match=rf"^{path}: damaged gzip file \("):
        detect_format(path)
    with pytest.raises(ValueError, match=rf"^{path}: damaged gzip file \("):  # (a forced format reads it all)
        read_trace(path, format="mooncake")


def test_a_damaged_second_gzip_member_is_a_damaged_gzip_file_too(tmp_path: Path):
    good = gzip.compress(("\n".join(_mooncake_line() for _ in range(2000)) + "\n").encode())
    path = _corrupt_gzip(tmp_path / "t.jsonl", 0)  # (the first line decodes: the damage is found reading rows)
    path.write_bytes(good + path.read_bytes())
    assert detect_format(path) == "mooncake"
    with pytest.raises(ValueError, match=rf"^{path}: damaged gzip file \("):
        read_trace(path)


def test_workload_show_refuses_a_corrupt_gzip_in_one_line_with_exit_2(tmp_path: Path):
    path = _corrupt_gzip(tmp_path / "g.jsonl", 0)
    r = CliRunner().invoke(app, ["workload", "show", str(path), "--json"])
    assert r.exit_code == 2, r.output
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["error"].startswith(f"{path}: damaged gzip file (") and r.stderr.strip() == f"error: {last['error']}"


def test_json_lines_nested_past_the_parsers_recursion_are_bad_rows(tmp_path: Path):
    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "deep.jsonl"
    path.write_text(_mooncake_line() + "\n" + _mooncake_line()[:-1] + f', "x": {deep}}}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not valid JSON \(nested too deeply\)$"):
        read_trace(path)
    workload = read_trace(path, skip_bad_rows=True)
    assert len(workload) == 1 and "skipped 1 bad row" in " ".join(workload.notes)
    first = tmp_path / "first.jsonl"  # (detecting the format reads the first line alone)
    first.write_text(f'{{"input_length": 10, "output_length": 5, "x": {deep}}}\n')
    with pytest.raises(ValueError, match=rf"^{first}: unknown trace format"):
        read_trace(first)
