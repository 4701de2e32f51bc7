"""Readers for the public LLM-serving trace formats, with format detection by content.

    azure     Azure LLM inference trace 2023/2024: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``
    mooncake  Mooncake (FAST'25): JSONL ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``
    burstgpt  BurstGPT: CSV ``Timestamp,Model,Request tokens,Response tokens,...`` (v2 adds ``Session ID``)
    lengths   length-only CSV ``num_prefill_tokens,num_decode_tokens`` (ShareGPT/arXiv/BWB), arrivals generated

A malformed row (among them a length above `MAX_TOKENS`, a timestamp past `MAX_TIMESTAMP_S`) raises
``ValueError("FILE:LINE: column NAME: ...")`` unless ``skip_bad_rows`` is set, in which case it is skipped and
counted in the workload's ``notes``. Rows with 0 output tokens (failed requests) or 0 input tokens cannot be
replayed: they are dropped and counted in ``notes`` too. Timestamps spanning more than `MAX_SPAN_S` are refused.
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import math
import zlib
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Iterator

import numpy as np

from skistune.config import shown
from skistune.workloads.model import MAX_TOKENS, Workload, chain_blocks, gather_blocks, recut_blocks
from skistune.workloads.synthetic import SESSION_BLOCK_TOKENS, burstiness_notes, renewal_arrivals
from skistune.workloads.transforms import QUANTUM_NOTE

FORMATS: dict[str, str] = {
    "azure": "CSV TIMESTAMP,ContextTokens,GeneratedTokens (Azure LLM inference trace)",
    "mooncake": "JSONL timestamp,input_length,output_length,hash_ids (Mooncake)",
    "burstgpt": "CSV Timestamp,Model,Request tokens,Response tokens,... (BurstGPT)",
    "lengths": "CSV num_prefill_tokens,num_decode_tokens (length-only; arrivals generated)",
}
_CSV_SIGNATURES = {  # the columns each CSV format must have (detection and reading)
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
    "lengths": ("num_prefill_tokens", "num_decode_tokens"),
}
MOONCAKE_BLOCK_TOKENS = 512  # Mooncake's hash_ids name 512-token blocks


@dataclass(frozen=True)
class ArrivalSpec:
    """Arrivals for traces that have none (length-only files): a seeded renewal process."""

    rate_rps: float = 1.0
    burstiness: float = 1.0  # coefficient of variation of inter-arrival times; 1 is Poisson
    seed: int = 0


# what reading a damaged gzip file raises: cut short (EOFError), a bad header (BadGzipFile), or compressed data
# that does not decode (zlib.error: random bytes after a valid header)
GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def open_text(path: Path) -> io.TextIOBase:
    """Open a trace as text; gzip-compressed files (how large traces are often kept) are recognised."""
    with open(path, "rb") as raw:
        magic = raw.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _first_line(path: Path) -> str:
    with open_text(path) as f:
        for line in f:
            if line.strip():
                return line.strip()
    raise ValueError(f"{path}: empty trace (no rows)")


def detect_format(path: str | Path) -> str:
    """The trace format from the file's content (the first non-empty line), not its name."""
    path = Path(path)
    try:
        line = _first_line(path)
    except GZIP_ERRORS as exc:
        raise ValueError(f"{path}: damaged gzip file ({exc})") from None
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # (not JSON, an integer past Python's 4,300 digits, nested too deep)
            record = {}
        if isinstance(record, dict) and {"input_length", "output_length"} <= record.keys():
            return "mooncake"
    else:
        header = {name.strip() for name in next(csv.reader([line]))}
        for fmt, columns in _CSV_SIGNATURES.items():
            if set(columns) <= header:
                return fmt
    expected = ", ".join(f"{fmt} ({','.join(columns)})" for fmt, columns in _CSV_SIGNATURES.items())
    raise ValueError(f"{path}: unknown trace format (first line {line[:60]!r}): expected the CSV columns of "
                     f"{expected} or mooncake JSONL lines; force a format with --format")


class BadRows:
    """Raise on the first malformed row, or count and skip them all."""

    def __init__(self, path: Path, skip: bool) -> None:
        self.path, self.skip, self.count, self.first = path, skip, 0, ""

    def report(self, line_no: int, message: str) -> None:
        text = f"{self.path}:{line_no}: {message}"
        if not self.skip:
            raise ValueError(text)
        self.count += 1
        self.first = self.first or text

    def note(self) -> str | None:
        if self.count == 0:
            return None
        return f"skipped {self.count} bad row{'s' * (self.count != 1)} (first: {self.first})"


def read_trace(path: str | Path, *, format: str | None = None, skip_bad_rows: bool = False,
               block_tokens: int | None = None, arrivals: ArrivalSpec = ArrivalSpec()) -> Workload:
    """Read one trace file. ``format`` forces a format (else it is detected); ``block_tokens`` is the size
    of a Mooncake trace's hash blocks (512) or the block size at which sessions share prompts (16)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such trace file")
    try:
        fmt = detect_format(path) if format is None else format
        if fmt not in FORMATS:
            raise ValueError(f"format {shown(fmt)}: unknown (known: {', '.join(FORMATS)})")
        bad = BadRows(path, skip_bad_rows)
        if fmt == "mooncake":
            workload = _read_mooncake(path, bad, block_tokens or MOONCAKE_BLOCK_TOKENS)  # (rescaled if not 512)
        else:
            workload = _read_csv_format(path, fmt, bad, block_tokens or SESSION_BLOCK_TOKENS, arrivals)
    # bytes that are no text, or a damaged gzip file: the whole file is unreadable, not one row
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text trace (not UTF-8; binary or corrupted?)") from None
    except GZIP_ERRORS as exc:
        raise ValueError(f"{path}: damaged gzip file ({exc})") from None
    note = bad.note()
    return workload.with_note(note) if note else workload


# ---- CSV: a fast vectorised path, and a careful row-by-row path that names the bad row ----

# Timestamps no serving trace has (`1e300,...` was read, and replayed with 300-digit durations). Float64 seconds
# keep sub-microsecond steps below 2^32 s (epoch seconds, 1.7e9 today, are fine) and 15 us steps at
# MAX_TIMESTAMP_S (3,000 years); past it a number is no time in seconds (epoch milliseconds or nanoseconds in a
# seconds column, a corrupt row), and a few orders further float64 loses the milliseconds themselves. Nor has
# any LLM service logged for MAX_SPAN_S, 10 years (ChatGPT opened in 2022; public traces span an hour: Azure
# 2023, Mooncake; a week: Azure 2024; months: BurstGPT's 2 months and 110 days): a longer span is a bad row or
# a mistaken unit. The samples in shared/traces pass both by far: they span at most 11.5 h, and their raw
# times stay below 2e7 (BurstGPT_3's seconds since its first day; Mooncake's milliseconds reach 2.4e6).
MAX_TIMESTAMP_S = 1e11
YEAR_S = 365.25 * 86400.0
MAX_SPAN_S = 10 * YEAR_S
_TIME_COLUMNS = {"azure": "TIMESTAMP", "burstgpt": "Timestamp", "mooncake": "timestamp"}


class Kind(Enum):
    """What a CSV column holds."""

    COUNT = "count"  # a non-negative integer (token lengths)
    TIME = "time"  # seconds as a number, or an ISO date-time
    TEXT = "text"  # a key such as a session id


def _parse_counts(values: list[str]) -> np.ndarray | None:
    try:
        counts = np.array(values, dtype=np.int64)
    except (ValueError, OverflowError):
        return None
    return counts if counts.size == 0 or (counts.min() >= 0 and counts.max() <= MAX_TOKENS) else None


def _parse_times(values: list[str]) -> np.ndarray | None:
    """Seconds as float64: numbers are taken as seconds, ISO date-times ('2023-11-16 18:15:46.68') converted."""
    try:
        times_s = np.array(values, dtype=np.float64)
        return times_s if np.all(np.abs(times_s) <= MAX_TIMESTAMP_S) else None  # (False for nan and inf too)
    except ValueError:
        pass
    try:
        stamps = np.array(values, dtype="datetime64[ns]")
    except ValueError:
        return None
    return None if np.any(np.isnat(stamps)) else _stamps_to_s(stamps)


def _stamps_to_s(stamps: np.ndarray) -> np.ndarray:
    ns = stamps.astype("datetime64[ns]").astype(np.int64)
    return (ns - ns.min()).astype(np.float64) / 1e9  # relative first: float64 cannot hold epoch nanoseconds


def _parse_text(values: list[str]) -> np.ndarray:
    return np.array([value.strip() for value in values], dtype=object)


_FAST_PARSERS = {Kind.COUNT: _parse_counts, Kind.TIME: _parse_times, Kind.TEXT: _parse_text}


def _fast_columns(text: str, kinds: dict[str, Kind]) -> dict[str, np.ndarray] | None:
    """All columns at once when the file is plain (no quoting) and every value parses; else None."""
    if '"' in text:
        return None
    lines = text.splitlines()
    header = [name.strip() for name in lines[0].split(",")]
    body = [line for line in lines[1:] if line]  # blank lines carry no request
    n_cols = len(header)
    if any(line.count(",") != n_cols - 1 for line in body):
        return None
    flat = ",".join(body).split(",") if body else []
    columns: dict[str, np.ndarray] = {}
    for name, kind in kinds.items():
        parsed = _FAST_PARSERS[kind](flat[header.index(name)::n_cols])
        if parsed is None:
            return None
        columns[name] = parsed
    return columns


class _ValueChecker:
    """One value at a time, with the reason when it is bad. The first time value decides whether the
    column holds numbers (seconds) or date-times."""

    def __init__(self) -> None:
        self.times_are_numbers: bool | None = None

    def check(self, kind: Kind, value: str) -> tuple[object, str | None]:
        value = value.strip()
        if kind is Kind.TEXT:
            return value, None
        if kind is Kind.COUNT:
            digits = value.lstrip("0")
            if value.isdigit() and len(digits) > 4000:  # (int() refuses past 4,300 digits: that read "not an integer",
                return None, (f"length of {len(digits):,} digits is above {MAX_TOKENS:,} tokens, which no model's "
                              "context holds")  # echoing every digit)
            try:
                count = int(value)
            except ValueError:
                return None, f"{value[:40]!r}{'...' if len(value) > 40 else ''} is not an integer"
            return (count, None) if 0 <= count <= MAX_TOKENS else (None, _length_problem(count))
        return self._check_time(value)

    def _check_time(self, value: str) -> tuple[object, str | None]:
        if self.times_are_numbers is None:
            self.times_are_numbers = _is_float(value)
        if self.times_are_numbers:
            if not _is_float(value) or not math.isfinite(float(value)):
                return None, f"{shown(value)} is not a time in seconds"
            if abs(float(value)) > MAX_TIMESTAMP_S:
                return None, _time_problem(repr(value), "seconds")
            return float(value), None
        try:
            stamp = np.datetime64(value, "ns")
        except ValueError:
            return None, f"{shown(value)} is not a date-time"
        return (None, f"{shown(value)} is not a date-time") if np.isnat(stamp) else (stamp, None)


def _number_text(number: int | float) -> str:
    """A number for a message; a 400-digit integer as ~1e+399 (str() refuses over 4,300 digits)."""
    if isinstance(number, float):
        return f"{number:g}"
    return str(number) if abs(number) < 10**24 else f"{'-' * (number < 0)}~1e+{int(math.log10(abs(number)))}"


def _length_problem(count: int) -> str:
    if count < 0:
        return f"negative length {_number_text(count)}"
    return f"length {_number_text(count)} is above {MAX_TOKENS:,} tokens, which no model's context holds"


def _time_problem(value: str, unit: str) -> str:
    """``value`` as the file has it; ``unit`` "seconds" or "milliseconds"."""
    limit = f"{MAX_TIMESTAMP_S:g} s" if unit == "seconds" else f"{MAX_TIMESTAMP_S * 1000:g} ms"
    return f"{value} is beyond {limit} (3,000 years): not a time in {unit}"


def _is_float(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _slow_columns(path: Path, kinds: dict[str, Kind], bad: BadRows) -> dict[str, np.ndarray]:
    """With line numbers: every row's field count, then each column parsed at once and, where that fails,
    value by value to find the bad ones. The first bad row raises (or every bad row is counted and skipped)."""
    raw: dict[str, list[str]] = {name: [] for name in kinds}
    line_nos: list[int] = []
    problems: dict[int, str] = {}  # line number -> what is wrong there
    with open_text(path) as f:
        reader = csv.reader(f)
        header = [name.strip() for name in next(reader)]
        index = {name: header.index(name) for name in kinds}
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != len(header):
                problems[reader.line_num] = _field_count_problem(row, header)
                continue
            line_nos.append(reader.line_num)
            for name, j in index.items():
                raw[name].append(row[j])
    checker = _ValueChecker()
    for name, kind in kinds.items():
        for position, problem in _bad_values(kind, raw[name], checker):
            problems.setdefault(line_nos[position], f"column {name}: {problem}")
    for line_no in sorted(problems):
        bad.report(line_no, problems[line_no])
    good = [k for k, line_no in enumerate(line_nos) if line_no not in problems] if problems else range(len(line_nos))
    return {name: _column_array(kind, [raw[name][k] for k in good], checker) for name, kind in kinds.items()}


def _field_count_problem(row: list[str], header: list[str]) -> str:
    if len(row) < len(header):
        return f"column {header[len(row)]}: missing (row has {len(row)} of {len(header)} fields)"
    return f"column {len(header) + 1}: unexpected extra field {shown(row[len(header)])}"


def _bad_values(kind: Kind, values: list[str], checker: _ValueChecker) -> list[tuple[int, str]]:
    """(position, problem) of each bad value; one vectorised parse when the whole column is good."""
    if _FAST_PARSERS[kind](values) is not None:
        return []
    found = []
    for position, value in enumerate(values):
        problem = checker.check(kind, value)[1]
        if problem:
            found.append((position, problem))
    return found


def _column_array(kind: Kind, values: list[str], checker: _ValueChecker) -> np.ndarray:
    parsed = _FAST_PARSERS[kind](values)
    if parsed is not None:
        return parsed
    # values that pass one by one but not together (numbers and date-times mixed): the checker decides
    checked = [checker.check(kind, value)[0] for value in values]
    if kind is Kind.TIME and checked and isinstance(checked[0], np.datetime64):
        return _stamps_to_s(np.array(checked, dtype="datetime64[ns]"))
    return np.array(checked, dtype=np.int64 if kind is Kind.COUNT else np.float64)


def _csv_columns(path: Path, fmt: str, bad: BadRows) -> dict[str, np.ndarray]:
    with open_text(path) as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"{path}: empty trace (no rows)")
    header = [name.strip() for name in next(csv.reader([text.split("\n", 1)[0]]))]
    missing = [name for name in _CSV_SIGNATURES[fmt] if name not in header]
    if missing:
        raise ValueError(f"{path}:1: column {missing[0]}: missing from the header (format {fmt}: {FORMATS[fmt]})")
    kinds = {name: Kind.COUNT for name in _CSV_SIGNATURES[fmt]}
    kinds.update({name: Kind.TIME for name in ("TIMESTAMP", "Timestamp") if name in header})
    if fmt == "burstgpt" and "Session ID" in header:
        kinds["Session ID"] = Kind.TEXT
    return _fast_columns(text, kinds) or _slow_columns(path, kinds, bad)


def _read_csv_format(path: Path, fmt: str, bad: BadRows, block_tokens: int, arrivals: ArrivalSpec) -> Workload:
    columns = _csv_columns(path, fmt, bad)
    if fmt == "azure":
        rows = _Rows(columns["TIMESTAMP"], columns["ContextTokens"], columns["GeneratedTokens"])
    elif fmt == "burstgpt":
        rows = _Rows(columns["Timestamp"], columns["Request tokens"], columns["Response tokens"],
                     sessions=columns.get("Session ID"))
    else:
        rows = _Rows(_generated_arrivals(path, len(columns["num_prefill_tokens"]), arrivals),
                     columns["num_prefill_tokens"], columns["num_decode_tokens"])
    workload = _assemble(path, fmt, rows, block_tokens, bad)
    if fmt == "lengths":
        workload = replace(workload, generated_arrivals=True, requested_burstiness=arrivals.burstiness).with_note(
            f"arrivals generated: rate {arrivals.rate_rps:g} req/s, burstiness {arrivals.burstiness:g} "
            f"(seed {arrivals.seed}); the file has lengths only")
        workload = replace(workload, notes=workload.notes + burstiness_notes(workload.arrival_s, arrivals.burstiness))
    return workload


def _generated_arrivals(path: Path, n: int, arrivals: ArrivalSpec) -> np.ndarray:
    """Arrivals for a length-only file's ``n`` rows; none for none (`_assemble` then says "empty trace")."""
    if n == 0:
        return np.zeros(0)
    return renewal_arrivals(n, arrivals.rate_rps, arrivals.burstiness, np.random.default_rng(arrivals.seed))


# ---- Mooncake JSONL ----

def _check_count(record: dict, key: str) -> str | None:
    value = record.get(key)
    if key not in record:
        return f"column {key}: missing"
    if isinstance(value, bool) or not isinstance(value, int):
        return f"column {key}: {shown(value)} is not an integer"
    return f"column {key}: {_length_problem(value)}" if not 0 <= value <= MAX_TOKENS else None


def _check_mooncake(record: object, block_tokens: int) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    timestamp = record.get("timestamp")
    # (finiteness of floats only: math.isfinite overflowed on a 400-digit integer, which the bound then refuses)
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or (
            isinstance(timestamp, float) and not math.isfinite(timestamp)):
        return f"column timestamp: {shown(timestamp)} is not a time in milliseconds"
    if abs(timestamp) > MAX_TIMESTAMP_S * 1000:
        return f"column timestamp: {_time_problem(_number_text(timestamp), 'milliseconds')}"
    problem = _check_count(record, "input_length") or _check_count(record, "output_length")
    if problem:
        return problem
    hash_ids = record.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(type(h) is int and 0 <= h < 2**63 for h in hash_ids):
        return "column hash_ids: not a list of non-negative integers"
    if len(hash_ids) > -(-record["input_length"] // block_tokens):
        return (f"column hash_ids: {len(hash_ids)} blocks of {block_tokens} tokens are more than "
                f"input_length {record['input_length']} holds")
    return None


def _mooncake_records(path: Path, bad: BadRows, block_tokens: int) -> Iterator[dict]:
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # so an error's position is on this line
            except json.JSONDecodeError as exc:
                # ("character", not "column": a column is a field elsewhere in these messages)
                bad.report(line_no, f"character {exc.colno}: not valid JSON ({exc.msg})")
                continue
            except ValueError:  # (Python's limit on integer digits, which told to call sys.set_int_max_str_digits)
                bad.report(line_no, "not valid JSON (a number of over 4,300 digits)")
                continue
            except RecursionError:  # (lists or objects nested thousands deep: the parser's recursion ran out)
                bad.report(line_no, "not valid JSON (nested too deeply)")
                continue
            problem = _check_mooncake(record, block_tokens)
            if problem:
                bad.report(line_no, problem)
                continue
            yield record


def _read_mooncake(path: Path, bad: BadRows, block_tokens: int) -> Workload:
    """The trace's 512-token hash blocks, re-cut into ``block_tokens``-token blocks when that differs: its ids
    name 512-token blocks whatever block size is asked, so relabelling them would call 512 tokens 16."""
    timestamps_ms, inputs, outputs, counts, ids = [], [], [], [], []
    for record in _mooncake_records(path, bad, MOONCAKE_BLOCK_TOKENS):
        timestamps_ms.append(record["timestamp"])
        inputs.append(record["input_length"])
        outputs.append(record["output_length"])
        hash_ids = record.get("hash_ids", [])
        counts.append(len(hash_ids))
        ids.append(hash_ids)
    block_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=block_offsets[1:])
    block_ids = np.fromiter((h for hash_ids in ids for h in hash_ids), dtype=np.int64, count=int(block_offsets[-1]))
    rows = _Rows(np.array(timestamps_ms, dtype=np.float64) / 1000.0, np.array(inputs, dtype=np.int64),
                 np.array(outputs, dtype=np.int64), block_offsets=block_offsets, block_ids=block_ids)
    workload = _assemble(path, "mooncake", rows, MOONCAKE_BLOCK_TOKENS, bad)
    if block_tokens == MOONCAKE_BLOCK_TOKENS:
        return workload
    block_offsets, block_ids = recut_blocks(workload.block_offsets, workload.block_ids, workload.input_tokens,
                                            MOONCAKE_BLOCK_TOKENS, block_tokens)
    return replace(workload, block_offsets=block_offsets, block_ids=block_ids, block_tokens=block_tokens).with_note(
        f"hash ids name {MOONCAKE_BLOCK_TOKENS}-token blocks: re-cut into {block_tokens}-token blocks "
        "(derived ids, equal where the prefixes are)")


# ---- shared: drop unreplayable rows, sort, rebase, sessions ----

@dataclass
class _Rows:
    """Columns as read, before cleaning (file order)."""

    time_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    sessions: np.ndarray | None = None  # session keys (strings; '' for none)
    block_offsets: np.ndarray | None = None
    block_ids: np.ndarray | None = None


def _assemble(path: Path, fmt: str, rows: _Rows, block_tokens: int, bad: BadRows) -> Workload:
    """Drop unreplayable rows, sort by arrival, start the clock at the first arrival, link sessions."""
    if len(rows.time_s) == 0:
        skipped = f"; {bad.count} bad skipped" if bad.count else ""
        raise ValueError(f"{path}: empty trace (no rows{skipped})")
    notes = _dropped_notes(rows.input_tokens, rows.output_tokens)
    index = np.flatnonzero((rows.output_tokens > 0) & (rows.input_tokens > 0))  # row numbers in the file
    if len(index) == 0:
        raise ValueError(f"{path}: empty trace (no request with both input and output tokens)")
    backwards = int(np.sum(np.diff(rows.time_s[index]) < 0))
    if backwards:
        index = index[np.argsort(rows.time_s[index], kind="stable")]
        notes.append(f"timestamps not in order ({backwards} step{'s' * (backwards != 1)} back in time): "
                     "sorted by arrival")
    arrival_s = rows.time_s[index] - rows.time_s[index[0]]
    if fmt != "lengths" and arrival_s[-1] > MAX_SPAN_S:  # (generated arrivals span what their rate says)
        raise ValueError(f"{path}: column {_TIME_COLUMNS[fmt]}: the timestamps span {arrival_s[-1]:.3g} s "
                         f"({arrival_s[-1] / YEAR_S:,.0f} years), more than any serving trace ({MAX_SPAN_S / YEAR_S:g} "
                         "years at most): a bad row, or times not in seconds")
    if rows.block_offsets is None:
        block_offsets, block_ids = np.zeros(len(index) + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    else:
        block_offsets, block_ids = gather_blocks(rows.block_offsets, rows.block_ids, index)
    session_ids = index if rows.sessions is None else _session_numbers(rows.sessions[index])
    workload = Workload(name=trace_name(path), arrival_s=arrival_s, input_tokens=rows.input_tokens[index],
                        output_tokens=rows.output_tokens[index], block_offsets=block_offsets, block_ids=block_ids,
                        session_ids=session_ids, request_ids=index, block_tokens=block_tokens,
                        source=f"{path} ({fmt})", notes=tuple(notes) + _quantum_note(arrival_s))
    return workload if rows.sessions is None else _with_sessions(workload)


def trace_name(path: Path) -> str:
    """A trace's workload name: its file name up to the first dot (``conv`` of conv.csv.gz)."""
    return path.name.split(".")[0]


def _dropped_notes(input_tokens: np.ndarray, output_tokens: np.ndarray) -> list[str]:
    notes = []
    n_read = len(input_tokens)
    failed = int(np.sum(output_tokens == 0))
    if failed:
        notes.append(f"dropped {failed} of {n_read} rows with 0 output tokens (failed requests)")
    no_prompt = int(np.sum((input_tokens == 0) & (output_tokens > 0)))
    if no_prompt:
        notes.append(f"dropped {no_prompt} of {n_read} rows with 0 input tokens (no prompt to serve)")
    return notes


def _quantum_note(arrival_s: np.ndarray) -> tuple[str, ...]:
    """Traces that record arrivals in coarse steps (Mooncake: 3 s) replay as bursts unless jittered."""
    distinct_s = np.unique(arrival_s)
    if len(distinct_s) < 2 or len(distinct_s) > len(arrival_s) // 2:
        return ()
    step_s = float(np.median(np.diff(distinct_s)))
    if step_s < 1.0:
        return ()
    return (f"{QUANTUM_NOTE} {step_s:g} s ({len(distinct_s)} distinct for {len(arrival_s)} "
            f"requests): spread them with jitter_s={step_s:g} (--jitter {step_s:g})",)


def _session_numbers(keys: np.ndarray) -> np.ndarray:
    """Session keys as integers; a request without a key (API calls) is a session of its own."""
    _, numbers = np.unique(keys.astype(str), return_inverse=True)
    lone = np.flatnonzero(keys.astype(str) == "")
    numbers = numbers.astype(np.int64)
    numbers[lone] = numbers.max(initial=0) + 1 + np.arange(len(lone))
    return numbers


def _with_sessions(workload: Workload) -> Workload:
    """Turns of a session re-send the conversation so far: link each turn to the previous one."""
    last_turn: dict[int, int] = {}
    prev_turn: list[int | None] = []
    for i, session in enumerate(workload.session_ids.tolist()):
        prev_turn.append(last_turn.get(session))
        last_turn[session] = i
    block_offsets, block_ids = chain_blocks(workload.input_tokens, prev_turn, workload.block_tokens)
    return replace(workload, block_offsets=block_offsets, block_ids=block_ids)
