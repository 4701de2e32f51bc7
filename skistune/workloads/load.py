"""`load_workload`: one way to name a workload everywhere (``--workload chat``, ``--workload trace.csv``)."""
from __future__ import annotations

import math
import numbers
from dataclasses import replace
from pathlib import Path

from skistune.config import did_you_mean
from skistune.workloads import transforms
from skistune.workloads.model import MAX_TOKENS, Workload
from skistune.workloads.readers import FORMATS, ArrivalSpec, read_trace, trace_name
from skistune.workloads.synthetic import SESSION_BLOCK_TOKENS, PRESETS, synthesize

TRACE_SUFFIXES = (".csv", ".jsonl", ".json")  # (formats are detected by content; names only guide a hint)
FEW_FILES = 3  # a directory holding at most this many trace-like files has them named in the error
# Magnitudes no serving workload means (`--rate 1e300` gave a 1e-299 s trace, `--length-scale 1e9` 1e12-token
# prompts): the busiest deployments serve thousands of requests a second, so a mean gap under a microsecond is
# a typo; and no request is longer than `MAX_TOKENS` (model.py: the readers refuse such rows too).
MAX_RATE_RPS = 1e6
MIN_RATE_RPS = 1e-6  # a mean gap over 11 days: no service's load (`--rate 1e-300` spanned 1e300 s, overflowing)


def _in_python(*keywords: str) -> str:
    """The tail of a message that names a CLI option: the keyword(s) `load_workload` takes for it. The same
    check serves both, and the caller's spelling is unknown here; the option leads (most callers type it)."""
    return f" (in Python: {', '.join(f'{keyword}=' for keyword in keywords)})"


def load_workload(spec: str | Path | Workload, *, format: str | None = None, skip_bad_rows: bool = False,
                  seed: int = 0, requests: int | None = None, rate_rps: float | None = None,
                  burstiness: float | None = None, block_tokens: int | None = None, jitter_s: float | None = None,
                  window_s: tuple[float, float] | None = None, first: int | None = None, sample: int | None = None,
                  length_scale: float = 1.0, max_input: int | None = None, max_output: int | None = None,
                  rate_scale: float = 1.0) -> Workload:
    """A preset name (``chat``, ``code``, ``long-context``, ``agent``), a trace file, or a `Workload`,
    then the transformations, in this order: jitter, time window, first N, random sample of N (seeded),
    length scale and caps, rate.

    ``rate_rps`` is the mean arrival rate before ``rate_scale`` of the workload returned: a preset's or a
    length-only trace's generated arrivals, or a timed trace's arrivals rescaled to it (generated arrivals
    thinned by the window, first N or sample are rescaled back to it). ``burstiness`` (inter-arrival CV) and
    ``requests`` only apply where arrivals are generated. ``jitter_s`` must be > 0 (0 would spread nothing).
    ``seed`` seeds everything random. A preset name wins over a file of the same name (write ``./chat`` for
    the file).
    """
    for name, value in (("rate_rps", rate_rps), ("rate_scale", rate_scale), ("burstiness", burstiness),
                        ("jitter_s", jitter_s)):
        # (inf would put every arrival at 0, nan none anywhere: refused by name before anything is read)
        if value is not None and not (isinstance(value, numbers.Real) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    if rate_rps is not None and rate_out_of_range(rate_rps):
        raise ValueError(f"--rate {rate_rps:g} req/s: {rate_out_of_range(rate_rps)}{_in_python('rate_rps')}")
    workload = _source(spec, format=format, skip_bad_rows=skip_bad_rows, seed=seed, requests=requests,
                       rate_rps=rate_rps, burstiness=burstiness, block_tokens=block_tokens)
    if jitter_s is not None:
        workload = transforms.jitter(workload, jitter_s, seed)
    if window_s is not None:
        workload = transforms.time_window(workload, *window_s)
    if first is not None:
        workload = transforms.first_n(workload, first)
    if sample is not None:
        workload = transforms.sample_n(workload, sample, seed)
    _check_length_scale(workload, length_scale)
    if length_scale != 1.0 or max_input is not None or max_output is not None:
        workload = transforms.scale_lengths(workload, length_scale, max_input=max_input, max_output=max_output)
    if rate_rps is not None and not _rate_holds(workload, rate_rps, generated=not isinstance(spec, Workload)):
        workload = transforms.set_rate(workload, rate_rps)
    if rate_scale != 1.0:
        workload = transforms.scale_rate(workload, rate_scale)
        rate = len(workload) / workload.duration_s if workload.duration_s > 0 else 0.0
        # (blamed on the scale only in the direction it moved the rate: a scale below 1 never made it too high)
        if rate > 0 and rate_out_of_range(rate) and (rate > MAX_RATE_RPS) == (rate_scale > 1):
            raise ValueError(f"--rate-scale {rate_scale:g}: gives {rate:.3g} req/s, {rate_out_of_range(rate)}"
                             f"{_in_python('rate_scale')}")
    if isinstance(spec, Workload):
        return workload
    given = dict(format=format, skip_bad_rows=skip_bad_rows, seed=seed, requests=requests, rate_rps=rate_rps,
                 burstiness=burstiness, block_tokens=block_tokens, jitter_s=jitter_s, window_s=window_s, first=first,
                 sample=sample, length_scale=length_scale, max_input=max_input, max_output=max_output,
                 rate_scale=rate_scale)
    defaults = dict(skip_bad_rows=False, seed=0, length_scale=1.0, rate_scale=1.0)
    return replace(workload, loaded_with={"spec": str(spec), **{k: v for k, v in given.items()
                                                                 if v is not None and v != defaults.get(k)}})


def rate_out_of_range(rate_rps: float) -> str | None:
    """Why an arrival rate is no serving workload's (`MIN_RATE_RPS`, `MAX_RATE_RPS`), or None."""
    if rate_rps > MAX_RATE_RPS:
        return f"above {MAX_RATE_RPS:g} req/s (a mean gap under a microsecond), which no server sustains"
    if rate_rps < MIN_RATE_RPS:
        return f"below {MIN_RATE_RPS:g} req/s (a mean gap over 11 days), which is no service's load"
    return None


def _check_length_scale(workload: Workload, length_scale: float) -> None:
    """Refuse a scale that makes a request longer than `MAX_TOKENS`, before the caps: a cap would hide the
    nonsense lengths but not the block size, which scales with them (16 -> 16e9 tokens at 1e9)."""
    longest = int(max(workload.input_tokens.max(), workload.output_tokens.max()))
    # (a scale of 1 or less lengthens nothing; nan and inf are left to scale_lengths, which names them)
    if length_scale > 1 and math.isfinite(length_scale) and longest * length_scale > MAX_TOKENS:
        raise ValueError(f"--length-scale {length_scale:g}: makes the longest request {longest:,} x {length_scale:g} "
                         f"= {longest * length_scale:.3g} tokens, above {MAX_TOKENS:,}, which no model's context "
                         f"holds{_in_python('length_scale')}")


def workload_name(spec: str | Path) -> str:
    """The name `load_workload` (spec) will have, known before reading: for --plot's file in a folder."""
    return str(spec) if str(spec) in PRESETS else trace_name(Path(spec))


def _rate_holds(workload: Workload, rate_rps: float, *, generated: bool) -> bool:
    """Whether arrivals generated at ``rate_rps`` still have it: a sample of 100 of a preset's 2,000 requests
    keeps their times, so it had 1/20 of the rate asked for. One request has no rate to set (nor to miss)."""
    if not (generated and workload.generated_arrivals):
        return False
    return workload.duration_s == 0 or math.isclose(len(workload) / workload.duration_s, rate_rps, rel_tol=1e-9)


def _source(spec: str | Path | Workload, *, format: str | None, skip_bad_rows: bool, seed: int,
            requests: int | None, rate_rps: float | None, burstiness: float | None,
            block_tokens: int | None) -> Workload:
    if isinstance(spec, Workload):
        return spec
    if format is not None and format not in FORMATS:  # checked first: else the preset or file would be blamed
        raise ValueError(f"--format {format!r}: unknown (known: {', '.join(FORMATS)})")
    path = Path(spec)
    if str(spec) in PRESETS:
        if format is None:
            return synthesize(str(spec), requests=requests, seed=seed, rate_rps=rate_rps, burstiness=burstiness,
                              block_tokens=block_tokens or SESSION_BLOCK_TOKENS)
        if not path.is_file():  # (with --format, a file of a preset's name is read: that is what was meant)
            raise ValueError(f"workload {str(spec)!r} is a preset: --format applies to trace files; write ./{spec} "
                             f"for a file of that name{_in_python('format')}")
    if path.is_dir():
        raise ValueError(f"workload {str(spec)!r}: a directory, neither a preset ({', '.join(PRESETS)}) nor a trace "
                         f"file{_files_in(path)}")
    if not path.is_file():
        raise ValueError(f"workload {str(spec)!r}{did_you_mean(spec, PRESETS)}: neither a preset ({', '.join(PRESETS)}) "
                         "nor an existing file")
    if requests is not None:
        raise ValueError("--requests applies to presets; take part of a trace with --first or --sample"
                         f"{_in_python('requests', 'first', 'sample')}")
    arrivals = ArrivalSpec(rate_rps=1.0 if rate_rps is None else rate_rps,
                           burstiness=1.0 if burstiness is None else burstiness, seed=seed)
    workload = read_trace(path, format=format, skip_bad_rows=skip_bad_rows, block_tokens=block_tokens,
                          arrivals=arrivals)
    if burstiness is not None and not workload.generated_arrivals:
        raise ValueError(f"{path}: --burstiness applies to generated arrivals (presets, length-only traces); this "
                         f"trace has its own timestamps{_in_python('burstiness')}")
    return workload


def _files_in(folder: Path) -> str:
    """The hint after "a directory": the trace-like files in it (plain or gzipped), named when few."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                   and p.name.removesuffix(".gz").endswith(TRACE_SUFFIXES))
    if not names:
        return ""
    if len(names) > FEW_FILES:
        return f"; it holds {len(names)} trace-like files: name one"
    return f"; name a trace file in it: {', '.join(str(folder / name) for name in names)}"
