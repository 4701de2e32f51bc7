"""The model's projections (``x @ w.T`` with ``w [out, in]`` as stored), in the orientation this machine's
BLAS runs fastest for the step's shape (`rows.ProjectionRule`), measured once per machine and model.

A CPU step streams every weight from memory once (SmolLM2-135M's projections are 405 MiB). How fast a
BLAS streams them depends on the product's orientation and on the rows modulo 16, and differently on
each CPU (`rows` has the two hosts measured so far: flipping won 1.2-2.5x on one and lost 1.1-2.6x on
the other). So the rule is measured where it runs: `measure_rule` times passes over the model's own
weights (every layer's, streamed as a step streams them: timing one projection over and over keeps its
weight in the cache and gives the opposite answer at many sizes) in each orientation, and
`machine_rule` caches the result per machine, torch version, threads and weight shapes, so it is paid
once (0.6 s for SmolLM2 on a 2-core Intel host, where flipping loses at once and the timing stops).
Weights that fit in a cache (`SMALL_WEIGHTS_BYTES`), CUDA and ``SKISTUNE_PROJECTIONS=plain`` take the
plain product without measuring.

The orientations round differently, by about 2e-6 on unit-scale outputs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from .cache import cpu_identity, user_cache_dir
from .rows import PLAIN_RULE, ProjectionRule, padded_rows

__all__ = ["ProjectionRule", "PLAIN_RULE", "oriented_product", "linear", "measure_rule", "machine_rule", "pass_times"]

SMALL_WEIGHTS_BYTES = 64 << 20  # below this the weights stay in cache between steps: nothing to measure
MEASURED_BYTES = 1 << 30  # weights streamed per timed pass at most (the first layers of a larger model)
FLIP_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)  # rows at which flipped is timed against plain, in order
PAD_SIZES = {4: (12, 28, 60), 1: (15, 31, 63)}  # rows short of a multiple of 16, padded against flipped
MIN_GAIN = 1.10  # an orientation other than plain is taken only for at least this median speedup ...
MIN_PAD_GAIN = 1.05  # ... and padding for this much over the flipped product
ENV_SWITCH = "SKISTUNE_PROJECTIONS"  # "measured" (default) or "plain"
log = logging.getLogger(__name__)


def oriented_product(x: torch.Tensor, w: torch.Tensor, orientation: str) -> torch.Tensor:
    """``x @ w.T`` computed in ``orientation`` ("plain", "flipped" or "padded"), as rows ``[T, out]``,
    contiguous (the flipped product's transpose is copied: a few percent of the time it saves, and what
    follows runs on the layout it expects)."""
    if orientation == "plain":
        return F.linear(x, w)
    tokens = x.shape[0]
    if orientation == "padded":
        x = torch.cat([x, x.new_zeros(padded_rows(tokens) - tokens, x.shape[1])])
    return torch.mm(w, x.t()).t()[:tokens].contiguous()


def linear(x: torch.Tensor, w: torch.Tensor, rule: ProjectionRule = PLAIN_RULE) -> torch.Tensor:
    """``x [T, in] @ w.T`` -> ``[T, out]``, in the orientation ``rule`` gives for T rows (CPU only)."""
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, w)
    return oriented_product(x, w, rule.orientation(x.shape[0]))


def _pass_s(pairs: list[tuple[torch.Tensor, torch.Tensor]], orientation: str) -> float:
    t0 = time.perf_counter()
    for x, w in pairs:
        oriented_product(x, w, orientation)
    return time.perf_counter() - t0


def _speedup(weights: Sequence[torch.Tensor], rows: int, base: str, other: str, rounds: int) -> float:
    """Median over alternating rounds of (time of a pass in ``base``) / (time in ``other``): above 1,
    ``other`` is faster. A round's ratio holds while the machine's speed drifts between rounds."""
    inputs = {n: torch.randn(rows, n, dtype=weights[0].dtype) for n in {w.shape[1] for w in weights}}
    pairs = [(inputs[w.shape[1]], w) for w in weights]
    _pass_s(pairs, base), _pass_s(pairs, other)  # warm-up
    return statistics.median(_pass_s(pairs, base) / _pass_s(pairs, other) for _ in range(rounds))


def measure_rule(weights: Sequence[torch.Tensor], rounds: int = 3) -> ProjectionRule:
    """The rule for a step that streams ``weights`` (in step order, the LM head last), timed here:
    one row padded to two if that is `MIN_GAIN` faster; flipped from 2 rows up to the last of
    `FLIP_SIZES` before flipping first loses, if it gains `MIN_GAIN` over that range (geometric mean);
    then padding at 4 rows short of a multiple of 16 (else 1), where `MIN_PAD_GAIN` faster than flipped."""
    single = _speedup(weights, 1, "plain", "padded", rounds) >= MIN_GAIN
    flip_max, gains = 0, []
    for rows in FLIP_SIZES:
        gain = _speedup(weights, rows, "plain", "flipped", rounds)
        if gain < 1.0:
            break
        flip_max, gains = rows, gains + [gain]
    if gains and statistics.geometric_mean(gains) < MIN_GAIN:
        flip_max = 0
    pad = 0
    for short_by, sizes in PAD_SIZES.items():
        sizes = [s for s in sizes if s <= flip_max]
        if sizes and statistics.median(_speedup(weights, s, "flipped", "padded", rounds) for s in sizes) >= MIN_PAD_GAIN:
            pad = short_by
            break
    return ProjectionRule(flip_max, pad, single)


def pass_times(weights: Sequence[torch.Tensor], rows: Sequence[int], rule: ProjectionRule = PLAIN_RULE,
               rounds: int = 3) -> list[float]:
    """Median seconds of one pass over ``weights`` (in order, as a step streams them) at each of ``rows``
    rows, each product in the orientation ``rule`` gives, after a warm-up pass; sizes alternate within a
    round, so a drift of the machine's speed spreads over all of them."""
    device = weights[0].device
    inputs = {n: {r: torch.randn(r, n, dtype=weights[0].dtype, device=device) for r in rows}
              for n in {w.shape[1] for w in weights}}

    def one_pass(r: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for w in weights:
            linear(inputs[w.shape[1]][r], w, rule)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    with torch.inference_mode():
        for r in rows:
            one_pass(r)
        samples = [[one_pass(r) for r in rows] for _ in range(max(1, rounds))]
    return [statistics.median(s[i] for s in samples) for i in range(len(rows))]


def measured_weights(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The weights a measurement streams: all of them up to `MEASURED_BYTES`, then the last one (the LM
    head) as well."""
    out, total = [], 0
    for w in weights[:-1]:
        if total >= MEASURED_BYTES:
            break
        out.append(w)
        total += w.numel() * w.element_size()
    return out + [weights[-1]]


def _rule_path(weights: Sequence[torch.Tensor], label: str) -> Path:
    shapes = [tuple(w.shape) for w in weights]
    key = hashlib.sha256(json.dumps([cpu_identity(), torch.__version__, torch.get_num_threads(),
                                     str(weights[0].dtype), shapes]).encode()).hexdigest()[:16]
    return user_cache_dir("projections") / f"{label}-{key}.json"


_UNCACHED: dict[Path, ProjectionRule] = {}  # rules this process measured but could not cache, by cache entry


def machine_rule(weights: Sequence[torch.Tensor], label: str, fresh: bool = False) -> ProjectionRule:
    """The projection rule for a model whose weights a step streams in this order (LM head last) on this
    machine: from the cache, else measured now (`measure_rule`) and cached; ``fresh``: measured now and cached
    whatever the cache holds (a profile times the machine: a rule cached while it was busy can be a slow one).
    `PLAIN_RULE` off the CPU, for weights that fit in a cache, and with ``SKISTUNE_PROJECTIONS=plain``."""
    total = sum(w.numel() * w.element_size() for w in weights)
    if weights[0].device.type != "cpu" or total < SMALL_WEIGHTS_BYTES or os.environ.get(ENV_SWITCH) == "plain":
        return PLAIN_RULE
    path = _rule_path(weights, label)
    # (an unwritable cache had measured it again for every model built in the run)
    if path in _UNCACHED and not fresh:
        return _UNCACHED[path]
    try:
        if not fresh:
            return ProjectionRule.from_dict(json.loads(path.read_text())["rule"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not measured yet, or a damaged entry: measured again and overwritten
    log.info("measuring this CPU's projection orientations for %s (once; cached in %s)", label, path.parent)
    t0 = time.perf_counter()
    with torch.inference_mode():
        rule = measure_rule(measured_weights(weights))
    record = {"rule": rule.to_dict(), "model": label, "measured_s": round(time.perf_counter() - t0, 2),
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # written aside, then moved: concurrent runs
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache costs a measurement per run, nothing else
        # (a warning, so that the command line prints it as its other warnings: the log line had no "warning:")
        warnings.warn(f"this CPU's projection rule is not cached ({exc.strerror or exc}: {path.parent}); it is "
                      "measured again in each run", RuntimeWarning, stacklevel=2)
        _UNCACHED[path] = rule
    return rule
