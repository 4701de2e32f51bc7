"""Workload transformations: pure functions from a `Workload` to a new one, recorded in ``transforms``.

Request identities (``request_ids``) and prefix block ids survive every transformation, so a request keeps
its prompt tokens and requests that shared a prefix still share it.
"""
from __future__ import annotations

import numpy as np

from skistune.workloads.model import Workload, truncate_blocks
from skistune.workloads.stats import burstiness as gaps_cv

# how a reader's note on coarse timestamps begins (`readers._quantum_note`): jittering answers it
QUANTUM_NOTE = "timestamps come in steps of"


def scale_rate(workload: Workload, factor: float) -> Workload:
    """Arrivals ``factor`` times as frequent (the same requests in 1/factor of the time)."""
    if not (factor > 0 and np.isfinite(factor)):  # inf would put every arrival at 0
        raise ValueError(f"rate scale must be > 0 and finite, got {factor}")
    return workload.with_transform(f"rate x{factor:g}", arrival_s=workload.arrival_s / factor)


def set_rate(workload: Workload, rate_rps: float) -> Workload:
    """Scale arrivals so that the mean rate (requests / duration) is ``rate_rps``."""
    if not (rate_rps > 0 and np.isfinite(rate_rps)):  # (inf would reach `scale_rate` as an infinite scale)
        raise ValueError(f"rate must be > 0 and finite (req/s), got {rate_rps}")
    if workload.duration_s == 0:
        coarse = any(note.startswith(QUANTUM_NOTE) or QUANTUM_NOTE in note for note in workload.notes)
        raise ValueError(f"workload {workload.name!r}: all requests arrive at once, it has no rate to set"
                         + ("; its timestamps are coarse: spread them with --jitter first (in Python: jitter_s=)"
                            if coarse else ""))
    return scale_rate(workload, rate_rps / (len(workload) / workload.duration_s))


def scale_lengths(workload: Workload, factor: float = 1.0, *, max_input: int | None = None,
                  max_output: int | None = None) -> Workload:
    """Prompt and output lengths times ``factor`` (at least 1 token), then capped at ``max_input`` and
    ``max_output``: e.g. to replay a GPU trace with a small model on a CPU. Prefix blocks scale with the
    prompts, so the share of each prompt that is reused stays the same; a cap keeps a prompt's prefix."""
    if not (factor > 0 and np.isfinite(factor)):  # inf lengths overflow the int64 token counts
        raise ValueError(f"length scale must be > 0 and finite, got {factor}")
    for name, cap in (("max_input", max_input), ("max_output", max_output)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be >= 1 token, got {cap}")
    block_offsets, block_ids, block_tokens = _scaled_blocks(workload, factor)
    input_tokens = np.maximum(1, np.rint(workload.input_tokens * factor)).astype(np.int64)
    output_tokens = np.maximum(1, np.rint(workload.output_tokens * factor)).astype(np.int64)
    if max_input is not None:
        input_tokens = np.minimum(input_tokens, max_input)
    if max_output is not None:
        output_tokens = np.minimum(output_tokens, max_output)
    # a prompt lists no more blocks than it holds (a cap or rounding may shorten it)
    block_offsets, block_ids = truncate_blocks(block_offsets, block_ids, -(-input_tokens // block_tokens))
    parts = ([f"lengths x{factor:g}"] if factor != 1.0 else []) + (
        [f"input <= {max_input}"] if max_input is not None else []) + (
        [f"output <= {max_output}"] if max_output is not None else [])
    description = ", ".join(parts) or "lengths x1"
    return workload.with_transform(description, input_tokens=input_tokens, output_tokens=output_tokens,
                                   block_offsets=block_offsets, block_ids=block_ids, block_tokens=block_tokens)


def _scaled_blocks(workload: Workload, factor: float) -> tuple[np.ndarray, np.ndarray, int]:
    """Blocks of ``block_tokens * factor`` tokens. Below one token, every ``group`` blocks merge into one
    named by the group's last id: a block id names the whole prefix up to its end, so the merged block
    is equal exactly where the originals were."""
    scaled_tokens = workload.block_tokens * factor
    group = 1 if scaled_tokens >= 1 else int(np.ceil(1.0 / scaled_tokens))
    block_tokens = max(1, int(round(scaled_tokens * group)))
    if group == 1:
        return workload.block_offsets, workload.block_ids, block_tokens
    counts = np.diff(workload.block_offsets)
    merged_counts = -(-counts // group)
    starts = np.repeat(workload.block_offsets[:-1], merged_counts)
    rank = np.arange(int(merged_counts.sum())) - np.repeat(np.cumsum(merged_counts) - merged_counts, merged_counts)
    last = np.minimum((rank + 1) * group, np.repeat(counts, merged_counts)) - 1  # last original block of each group
    block_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(merged_counts, out=block_offsets[1:])
    return block_offsets, workload.block_ids[starts + last], block_tokens


def first_n(workload: Workload, n: int) -> Workload:
    """The first ``n`` requests by arrival; all of them, recorded as such, when there are no more than ``n``
    (as `sample_n` does: provenance says what was kept, not what was asked), with a note when there are fewer."""
    if n < 1:
        raise ValueError(f"first: need >= 1 request, got {n}")
    if n >= len(workload):
        return _all_kept(workload, "first", n)
    return workload.take(np.arange(n)).with_transform(f"first {n}")


def sample_n(workload: Workload, n: int, seed: int = 0) -> Workload:
    """``n`` requests drawn at random without replacement (seeded), kept in arrival order, clock restarted."""
    if n < 1:
        raise ValueError(f"sample: need >= 1 request, got {n}")
    if n >= len(workload):
        return _all_kept(workload, "sample", n)
    index = np.sort(np.random.default_rng(seed).choice(len(workload), size=n, replace=False))
    sampled = workload.take(index)
    sampled = sampled.with_transform(f"sample {n} seed {seed}", arrival_s=sampled.arrival_s - sampled.arrival_s[0])
    return _thinned_note(sampled, len(workload))


def _thinned_note(sampled: Workload, drawn: int) -> Workload:
    """A random sample of generated arrivals thins them: the rate falls with the share kept, and the gaps' CV moves
    toward 1 (a Poisson process thinned stays one). Said in a note when the CV lands under half or over twice the
    one asked for: `--burstiness 4 --sample 200` had given 1.01 with nothing said."""
    asked = sampled.requested_burstiness
    realised = gaps_cv(sampled.arrival_s)
    if not sampled.generated_arrivals or asked is None or realised is None or asked / 2 <= realised <= asked * 2:
        return sampled
    return sampled.with_note(f"burstiness (CV of gaps) {realised:.2f} after sampling {len(sampled):,} of {drawn:,} "
                             f"generated arrivals, against the {asked:g} asked for: a random sample thins arrivals "
                             "toward a Poisson process (and their rate with them, unless --rate is given); generate "
                             f"{len(sampled):,} requests instead (--requests) to keep the arrival process")


def _all_kept(workload: Workload, what: str, n: int) -> Workload:
    """``first``/``sample`` of ``n`` from no more than ``n`` requests: all of them. Fewer than asked is said in a
    note too: `--requests 50 --sample 100` kept 50, which only the transforms row told, in brackets."""
    kept = workload.with_transform(f"{what} {n} (all {len(workload)})")
    if n == len(workload):
        return kept
    return kept.with_note(f"{what} {n}: the workload has only {len(workload)} requests, all kept")


def time_window(workload: Workload, start_s: float, end_s: float) -> Workload:
    """Requests arriving in [start_s, end_s) of the trace, with the clock restarted at ``start_s``."""
    if not 0 <= start_s < end_s:
        raise ValueError(f"--window {start_s:g}:{end_s:g}: a time window needs 0 <= start < end (seconds of the trace)")
    index = np.flatnonzero((workload.arrival_s >= start_s) & (workload.arrival_s < end_s))
    if len(index) == 0:
        raise ValueError(f"workload {workload.name!r}: no request arrives in {start_s:g}:{end_s:g} s "
                         f"(it spans 0:{workload.duration_s:g} s)")
    windowed = workload.take(index)
    return windowed.with_transform(f"window {start_s:g}:{end_s:g} s", arrival_s=windowed.arrival_s - start_s)


def jitter(workload: Workload, step_s: float, seed: int = 0) -> Workload:
    """Spread arrivals recorded in steps of ``step_s`` (Mooncake: 3 s) over each step: a request at t moves
    into [t, t + step_s). The offsets of the requests sharing a timestamp are sorted uniform draws given
    in trace order, so times within a step look Poisson while turns keep their order; seeded. Any other
    arrivals (finer timestamps, generated ones, a step wider than the trace's) move the same way and the
    requests are re-sorted by their new times: requests less than ``step_s`` apart may swap."""
    if not step_s > 0:
        raise ValueError(f"jitter step must be > 0 s, got {step_s}")
    offsets = np.random.default_rng(seed).random(len(workload))
    # within each group of equal timestamps (contiguous: arrivals are sorted) hand out the offsets in order
    offsets = offsets[np.lexsort((offsets, workload.arrival_s))]
    arrival_s = workload.arrival_s + step_s * offsets
    order = np.argsort(arrival_s, kind="stable")  # (the identity where timestamps sit on the step grid)
    notes = tuple(n for n in workload.notes if not n.startswith(QUANTUM_NOTE))
    # the new times go in with the new order: the old times in the new order are not sorted
    return workload.take(order, arrival_s[order]).with_transform(f"jitter {step_s:g} s seed {seed}", notes=notes)
