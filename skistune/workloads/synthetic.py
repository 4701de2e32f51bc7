"""Synthetic workloads: seeded arrivals, length distributions, multi-turn sessions, and the named presets.

Every preset number follows a published statistic of a public trace (see the traces' SOURCE.md files and
the comments below), or for lower tails and 16-token prefix reuse that trace's sample as `skistune workload
show` reads it; no trace rows are embedded. Lengths come from `QuantileLengths`, through the trace's
percentiles (the published median and p99 among them) and its published mean; arrivals from a renewal process
whose coefficient of variation is the burstiness (1 = Poisson; Gamma gaps, hyperexponential above a CV of 2), in
a time whose rate swings over minutes as the trace's does (`swinging_arrivals`); prefix reuse from multi-turn
sessions whose share of follow-up turns is calibrated so that the published prefix-reuse ratio holds. A draw
whose burstiness falls under half the one asked for says so in a note (`burstiness_notes`): few requests cannot
draw a high one.
"""
from __future__ import annotations

import bisect
import functools
import math
import numbers
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Mapping

import numpy as np

from skistune.host_memory import available_memory_bytes
from skistune.workloads.model import Workload, chain_blocks
from skistune.workloads.stats import burstiness as gaps_cv

SESSION_BLOCK_TOKENS = 16  # sessions share prompts at the KV block size of vLLM and of our runtime's default


# ---- arrivals ----

GAMMA_MAX_BURSTINESS = 2.0  # above it, gaps are hyperexponential (see `renewal_arrivals`)


def renewal_arrivals(n: int, rate_rps: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s, first at 0) of a renewal process whose inter-arrival CV is ``burstiness`` (1 is
    Poisson, above 1 bursty). Gaps are rescaled so the realised rate is exactly ``rate_rps`` (requests /
    duration), which a heavy-tailed draw would otherwise miss by a wide margin.

    Up to `GAMMA_MAX_BURSTINESS` the gaps are Gamma with shape 1/CV². Above it a Gamma puts most gaps at
    zero (shape 0.006 at Azure code's CV of 13.2: 82% of gaps exactly 0, none in the trace), so the gaps are
    a two-phase hyperexponential with balanced means instead: short exponential gaps, and rarely an idle one
    hundreds of mean gaps long, the bursts-then-idle-minutes shape of bursty traces (at CV 13.2 its median
    gap is 0.35 and its p99.9 about 180 mean gaps; Azure code's are 0.16 and 203)."""
    if n < 1 or rate_rps <= 0 or burstiness <= 0:
        raise ValueError(f"arrivals need n >= 1, rate_rps > 0 and burstiness > 0 (got {n}, {rate_rps}, {burstiness})")
    if burstiness <= GAMMA_MAX_BURSTINESS:
        shape = 1.0 / burstiness**2
        gaps_s = rng.gamma(shape, 1.0 / shape, size=n - 1)
    else:  # mean 1: phase i is chosen with probability p_i and has mean 1 / (2 p_i)
        cv2 = burstiness**2
        p_short = 0.5 * (1.0 + np.sqrt((cv2 - 1.0) / (cv2 + 1.0)))
        short = rng.random(n - 1) < p_short
        gaps_s = rng.exponential(1.0, size=n - 1) / (2.0 * np.where(short, p_short, 1.0 - p_short))
    arrival_s = np.zeros(n)
    np.cumsum(gaps_s, out=arrival_s[1:])
    if n > 1 and arrival_s[-1] > 0:
        arrival_s *= (n / rate_rps) / arrival_s[-1]
    return arrival_s


def swinging_arrivals(n: int, rate_rps: float, burstiness: float, swing: float, swing_time_s: float,
                      rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s, first at 0) whose rate swings slowly around ``rate_rps``, as a service's load does over
    minutes: the rate is ``rate_rps`` times exp(X(t)), X a stationary Ornstein-Uhlenbeck process of standard
    deviation ``swing`` and correlation time ``swing_time_s``, normalised to mean 1. The requests are a renewal
    process (`renewal_arrivals`) in the time that the rate makes pass, whose gap CV is chosen so that the gaps'
    CV over the whole draw is ``burstiness`` still: swings add to it a factor E[m] E[1/m] = exp(swing^2) on
    1 + CV^2 (slow swings: a gap sees one rate). ``swing`` 0 is `renewal_arrivals` itself.

    Azure conv's per-minute request counts swing with a CV of 0.21 beyond Poisson's, correlated over about 5
    minutes (the counts of neighbouring minutes: 0.81); a renewal process with its gap CV alone had 0.06 and no
    correlation, so its busiest minute was 1.13x the mean against the trace's 1.52 (`benchmarks/preset_fit.py`)."""
    if swing <= 0:
        return renewal_arrivals(n, rate_rps, burstiness, rng)
    if swing_time_s <= 0:
        raise ValueError(f"swing_time_s must be > 0, got {swing_time_s}")
    base_cv = math.sqrt(max((1.0 + burstiness**2) * math.exp(-swing**2) - 1.0, MIN_BASE_CV**2))
    expected_by = renewal_arrivals(n, 1.0, base_cv, rng)  # each request's place in expected requests (unit rate)
    # the rate on a grid of steps much shorter than its correlation time, over about the draw's duration, then
    # the expected requests by each grid time (extended at the mean rate if a slow spell left them short)
    step_s = swing_time_s / 20.0
    steps = int(math.ceil(1.5 * n / rate_rps / step_s)) + 2
    keep = math.exp(-step_s / swing_time_s)
    shocks = rng.normal(0.0, swing * math.sqrt(1.0 - keep * keep), steps)
    x = np.empty(steps)
    x[0] = rng.normal(0.0, swing)
    for i in range(1, steps):  # (an AR(1) recursion; a few thousand steps even at 10^6 requests)
        x[i] = keep * x[i - 1] + shocks[i]
    expected = np.concatenate(([0.0], np.cumsum(np.exp(x - swing**2 / 2.0)) * step_s * rate_rps))
    if expected[-1] < expected_by[-1]:
        more = int(math.ceil((expected_by[-1] - expected[-1]) / (rate_rps * step_s))) + 1
        expected = np.concatenate((expected, expected[-1] + rate_rps * step_s * np.arange(1, more + 1)))
    arrival_s = np.interp(expected_by, expected, np.arange(len(expected)) * step_s)
    arrival_s -= arrival_s[0]
    if n > 1 and arrival_s[-1] > 0:
        arrival_s *= (n / rate_rps) / arrival_s[-1]
    return arrival_s


MIN_BASE_CV = 0.1  # the gap CV of a swinging draw's renewal part never falls below this (near-regular gaps)


# Above GAMMA_MAX_BURSTINESS the CV rests on rare idle gaps, so n requests realise it only if their n - 1 gaps
# draw some: `--burstiness 50` at 2,000 requests drew none and came out Poisson (CV 1.01). Measured over 300
# seeds at CVs 3, 5, 13.2 and 30: with 1 idle gap expected, 55-60% of draws realised under half the CV asked
# for; with 2, 34-40%, and the median draw 0.6-0.7 of it. So the note names the requests that expect 2 idle
# gaps. Another construction would not do much better: n - 1 gaps cannot have a CV above sqrt(n - 2) at all
# (44.7 at 2,000 requests: 50 and 100 were impossible), and near that bound one gap holds nearly the whole
# trace; so the draws stay as they were (seeds give the arrivals they gave), and a draw under half the CV asked
# for gets a note rather than a refusal (benchmarks replay small bursty workloads: 12 requests at 4).
MIN_IDLE_GAPS = 2.0


def idle_gap_share(burstiness: float) -> float:
    """The share of gaps `renewal_arrivals` draws from its long (idle) phase; 0 for Gamma gaps."""
    if burstiness <= GAMMA_MAX_BURSTINESS:
        return 0.0
    cv2 = burstiness**2
    return 0.5 * (1.0 - np.sqrt((cv2 - 1.0) / (cv2 + 1.0)))


def min_requests(burstiness: float) -> int:
    """The fewest requests whose gaps are expected to hold `MIN_IDLE_GAPS` idle ones at ``burstiness``."""
    share = idle_gap_share(burstiness)
    return 1 if share == 0 else 1 + math.ceil(MIN_IDLE_GAPS / share)


def burstiness_notes(arrival_s: np.ndarray, requested: float) -> tuple[str, ...]:
    """A note when the arrivals drawn realise under half the CV asked for: the table shows both, but 1.01
    beside 100 with nothing said read as a working generator."""
    realised = gaps_cv(arrival_s)
    if realised is None or realised >= requested / 2:
        return ()
    n, share = len(arrival_s), idle_gap_share(requested)
    if share == 0:
        why = f"{n - 1:,} gaps are few for a stable CV"
    else:
        why = (f"a CV that high comes from idle gaps, one in about {1 / share:,.0f}, and these {n - 1:,} gaps "
               "drew too few")
    if requested > math.sqrt(max(n - 2, 0)):  # (all gaps but one 0: the highest CV n - 1 gaps can have)
        why += f" (no {n - 1:,} gaps can have a CV above {math.sqrt(max(n - 2, 0)):.2f})"
    more = f"at least {min_requests(requested):,} requests" if n < min_requests(requested) else "more requests"
    return (f"burstiness (CV of gaps) {realised:.2f} as generated, under half the {requested:g} asked for: {why}; "
            f"use {more}, or another seed",)


# ---- lengths ----

@functools.cache
def _normal_grid() -> tuple[np.ndarray, np.ndarray]:
    z = np.linspace(-8.0, 8.0, 32001)
    weight = np.exp(-0.5 * z * z)
    return z, weight / weight.sum()


@dataclass(frozen=True)
class QuantileLengths:
    """Token lengths through a trace's quantiles: ``quantiles`` maps percentiles (strictly between 0 and 100) to
    tokens and holds at least the median (50) and one above it.

    The log-length is piecewise linear in the normal score z between the quantiles given (a lognormal is one
    straight line through two of them), so every quantile given holds and shapes that no lognormal has do too:
    Azure conv's outputs put 29% of requests at 375-450 tokens, a second peak, and a lognormal through its
    median and p99 had put its p90 at 583 tokens against 424. Below the lowest quantile the line continues with
    the slope from it to the median; above the highest, with the lognormal's sigma through the median and it,
    or with ``mean``, with the slope that makes the mean hold (the top percent is where a trace's quantiles say
    least, and it carries much of the mean: Mooncake synthetic's inputs reach 191,378 tokens over a p99 of
    66,456). Draws are rounded and clipped to [min_tokens, max_tokens] (a floor such as a fixed system prompt,
    and a service's context or output limit)."""

    quantiles: Mapping[float, float] | tuple[tuple[float, float], ...]
    max_tokens: int
    mean: float | None = None
    min_tokens: int = 1
    top_sigma: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        knots = tuple(sorted((float(q), float(t)) for q, t in dict(self.quantiles).items()))
        object.__setattr__(self, "quantiles", knots)  # (a tuple: the lengths stay hashable, like the preset)
        percents = [q for q, _ in knots]
        tokens = [t for _, t in knots]
        if 50.0 not in percents or percents[-1] <= 50.0 or not 0 < percents[0] or percents[-1] >= 100:
            raise ValueError(f"lengths need the median (50) and a percentile above it, all strictly between 0 and "
                             f"100, got percentiles {percents}")
        if any(b < a for a, b in zip(tokens, tokens[1:])):
            raise ValueError(f"lengths' quantiles must not fall as the percentile rises, got {dict(knots)}")
        if not 1 <= self.min_tokens <= tokens[percents.index(50.0)] < tokens[-1] <= self.max_tokens:
            raise ValueError(f"lengths need 1 <= min_tokens <= p50 < the highest quantile <= max_tokens, got "
                             f"min_tokens {self.min_tokens}, quantiles {dict(knots)}, max_tokens {self.max_tokens}")
        sigma = _lognormal_sigma(knots)
        if self.mean is not None:
            sigma = _fit_top_sigma(knots, self.max_tokens, self.min_tokens, float(self.mean))
        object.__setattr__(self, "top_sigma", sigma)

    def quantile(self, percent: float) -> float:
        return self.from_normal(np.array([_normal_score(percent)]))[0]

    def from_normal(self, z: np.ndarray) -> np.ndarray:
        """The length at normal score ``z``: the quantile function, monotone in ``z``."""
        return _quantile_curve(z, self.quantiles, self.top_sigma, self.max_tokens, self.min_tokens)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.rint(self.from_normal(rng.standard_normal(n))).astype(np.int64)

    def expected_mean(self) -> float:
        z, weight = _normal_grid()
        return float(np.sum(self.from_normal(z) * weight))


def _normal_score(percent: float) -> float:
    return float(NormalDist().inv_cdf(percent / 100.0))


def _knot_lines(knots: tuple[tuple[float, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The quantiles as (normal score, log tokens) points."""
    return (np.array([_normal_score(q) for q, _ in knots]), np.log([t for _, t in knots]))


def _lognormal_sigma(knots: tuple[tuple[float, float], ...]) -> float:
    """The sigma of the lognormal through the median and the highest quantile."""
    z, log_tokens = _knot_lines(knots)
    return float((log_tokens[-1] - np.interp(0.0, z, log_tokens)) / z[-1])


def _quantile_curve(z: np.ndarray, knots: tuple[tuple[float, float], ...], top_sigma: float, max_tokens: int,
                    min_tokens: int) -> np.ndarray:
    knot_z, knot_log = _knot_lines(knots)
    median = float(np.interp(0.0, knot_z, knot_log))
    low_sigma = (median - knot_log[0]) / -knot_z[0] if knot_z[0] < 0 else _lognormal_sigma(knots)
    log_tokens = np.where(z < knot_z[0], knot_log[0] + low_sigma * (z - knot_z[0]),
                          np.where(z > knot_z[-1], knot_log[-1] + top_sigma * (z - knot_z[-1]),
                                   np.interp(z, knot_z, knot_log)))
    return np.clip(np.exp(np.minimum(log_tokens, math.log(max_tokens))), min_tokens, max_tokens)


MEAN_TOLERANCE = 0.01  # a mean out of reach by less than this share is taken as the nearest one reachable


@functools.lru_cache(maxsize=64)
def _fit_top_sigma(knots: tuple[tuple[float, float], ...], max_tokens: int, min_tokens: int, mean: float) -> float:
    """Bisection on the log of the slope above the highest quantile: a steeper top raises the mean."""
    z, weight = _normal_grid()

    def mean_at(sigma: float) -> float:
        return float(np.sum(_quantile_curve(z, knots, sigma, max_tokens, min_tokens) * weight))

    low, high = math.log(1e-6), math.log(1e4)
    flattest, steepest = mean_at(0.0), mean_at(math.exp(high))
    # (a mean a hair out of reach is the sample's percentiles against the whole file's mean, or a top that the
    # service's limit caps: Azure code's p99 is 7,436 tokens and its limit 7,437; its mean then reads 2,045 of 2,048)
    if flattest > mean >= flattest * (1 - MEAN_TOLERANCE):
        return 0.0
    if steepest < mean <= steepest * (1 + MEAN_TOLERANCE):
        return math.exp(high)
    if not flattest <= mean <= steepest:
        raise ValueError(f"no length distribution through the quantiles {dict(knots)} below {max_tokens} tokens has "
                         f"mean {mean} (reachable means: {flattest:.0f} to {steepest:.0f})")
    for _ in range(60):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if mean_at(math.exp(middle)) < mean else (low, middle)
    return math.exp(0.5 * (low + high))


@dataclass(frozen=True)
class EmpiricalLengths:
    """Lengths drawn (with replacement) from observed values, e.g. a length-only trace's column."""

    values: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.values or min(self.values) < 1:
            raise ValueError("empirical lengths need at least one value, all >= 1")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=n)


LengthDist = QuantileLengths | EmpiricalLengths


# ---- multi-turn sessions ----

def wire_sessions(arrival_s: np.ndarray, input_tokens: np.ndarray, follow_u: np.ndarray, follow_prob: float,
                  turn_gap_s: float, idle_s: float) -> list[int | None]:
    """The previous turn of each request, or None for a session's first turn.

    In arrival order, a request with ``follow_u < follow_prob`` continues the open session whose last
    prompt is the longest one shorter than its own (a conversation grows turn by turn), among sessions
    whose last turn came at least ``turn_gap_s`` earlier and at most ``idle_s`` earlier."""
    waiting: deque[tuple[float, int]] = deque()  # (eligible from, turn key): FIFO in time
    open_turns: list[int] = []  # turn keys, sorted: by prompt tokens, then request (`_turn_key`)
    prev_turn: list[int | None] = [None] * len(arrival_s)
    # (Python lists, not numpy arrays, in the loop, and one int a turn, not a tuple: indexing an array makes a
    # numpy scalar each time, and tuples compare element by element; a fifth faster. The floats and the order
    # are the same.)
    times, follow = arrival_s.tolist(), follow_u.tolist()
    for i, (now_s, tokens) in enumerate(zip(times, input_tokens.tolist(), strict=True)):
        while waiting and waiting[0][0] <= now_s:
            bisect.insort(open_turns, waiting.popleft()[1])
        if i % 1024 == 0:  # drop ended sessions now and then, so the list stays short
            open_turns = [key for key in open_turns if times[key & _REQUEST_MASK] >= now_s - idle_s]
        if follow[i] < follow_prob:
            prev_turn[i] = _pop_longest_below(open_turns, tokens, times, now_s - idle_s)
        waiting.append((now_s + turn_gap_s, _turn_key(tokens, i)))
    return prev_turn


_REQUEST_BITS = 40  # (2**40 requests: far past what any machine's memory holds, `check_request_count`)
_REQUEST_MASK = (1 << _REQUEST_BITS) - 1


def _turn_key(tokens: int, request: int) -> int:
    """One int that sorts as (prompt tokens, request) does."""
    return (tokens << _REQUEST_BITS) | request


def _pop_longest_below(open_turns: list[int], tokens: int, arrival_s: list[float],
                       ended_before_s: float) -> int | None:
    k = bisect.bisect_left(open_turns, tokens << _REQUEST_BITS) - 1  # (the last turn with a shorter prompt)
    while k >= 0 and arrival_s[open_turns[k] & _REQUEST_MASK] < ended_before_s:
        del open_turns[k]
        k -= 1
    return open_turns.pop(k) & _REQUEST_MASK if k >= 0 else None


def session_reuse(input_tokens: np.ndarray, prev_turn: list[int | None], block_tokens: int) -> float:
    """The prefix-reuse ratio that `chain_blocks` will give these sessions (full blocks of the previous turn)."""
    reused = sum(int(input_tokens[p]) // block_tokens for p in prev_turn if p is not None)
    return reused / float(np.sum(-(-input_tokens // block_tokens)))


def calibrate_follow_prob(arrival_s: np.ndarray, input_tokens: np.ndarray, follow_u: np.ndarray, target: float,
                          *, turn_gap_s: float, idle_s: float, block_tokens: int, max_requests: int = 8000) -> float:
    """The share of follow-up turns that gives prefix reuse ``target`` (bisection on the first requests);
    1.0 where even that falls short (the caller reports the reuse it reached)."""
    if target <= 0:
        return 0.0
    head = slice(0, max_requests)
    args = (arrival_s[head], input_tokens[head], follow_u[head])

    def reuse_at(prob: float) -> float:
        return session_reuse(input_tokens[head], wire_sessions(*args, prob, turn_gap_s, idle_s), block_tokens)

    if reuse_at(1.0) <= target:  # few requests, or short sessions: every request that can follow does
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(16):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if reuse_at(middle) < target else (low, middle)
    return 0.5 * (low + high)


def session_numbers(prev_turn: list[int | None]) -> np.ndarray:
    """Session id per request: a first turn opens a session, a follow-up inherits its previous turn's."""
    session_ids = np.zeros(len(prev_turn), dtype=np.int64)
    for i, p in enumerate(prev_turn):
        session_ids[i] = i if p is None else session_ids[p]
    return session_ids


# ---- presets ----

# Presets as data. Lengths: mean / p50 / p99 as published for each trace (SOURCE.md "Sample stats", which are
# whole-file figures for the Azure traces), max_tokens the largest value in that file, and the other percentiles
# (PERCENTILES) the sample files' own, computed with numpy as SOURCE.md's are. Through mean, p50 and p99 alone (a
# lognormal bent to hold the mean) the shapes were far off: Azure conv's output p90 at 583 tokens against 424 (its
# second peak at 375-450 tokens missed), its input p75 1,581 against 1,189, agent input p10 4,350 against 30;
# through the percentiles, the Kolmogorov-Smirnov distance to the trace is at most 0.07 (it was up to 0.16).
# min_tokens where the file has a floor. Burstiness: the coefficient of variation of the trace's inter-arrival
# times, as `skistune workload show` reports it. Prefix reuse: the trace's at 16-token blocks
# (SESSION_BLOCK_TOKENS, at which sessions are calibrated), read with --block-tokens 16; at Mooncake's own
# 512-token blocks it is lower (0.350 and 0.640), since a 512-token block shared only in part counts as unshared.
PERCENTILES = (1, 5, 10, 20, 25, 30, 40, 50, 60, 70, 75, 80, 90, 95, 99)


def _percentiles(*tokens: int) -> dict[int, int]:
    """`PERCENTILES` -> tokens, in that order."""
    if len(tokens) != len(PERCENTILES):
        raise ValueError(f"a preset's lengths give {len(PERCENTILES)} percentiles, got {len(tokens)}")
    return dict(zip(PERCENTILES, tokens))


PRESETS: dict[str, dict] = {
    "chat": dict(
        description="chat assistant: Azure OpenAI conversation service, Nov 2023 (Azure LLM inference trace, conv); "
                    "its multi-turn prefix reuse follows Mooncake's conversation trace (Azure publishes none)",
        rate_rps=5.53,  # Azure conv: 19,366 requests in 3,501.7 s
        burstiness=1.09,  # Azure conv: CV of inter-arrival times 1.094
        # Azure conv's rate over the hour: per-minute counts swing with a CV of 0.22 (0.21 beyond Poisson's), and
        # neighbouring minutes' counts correlate at 0.81 (at 10 s and 300 s: correlation times of 2-12 minutes). A
        # swing of 0.24 gives draws of the trace's length a per-minute CV of 0.22 on average (16 seeds: 0.223, sd
        # 0.064; an hour holds a dozen correlation times, so a draw's own CV reads low), neighbours at 0.75
        rate_swing=0.24, swing_time_s=300.0,
        input=dict(mean=1155, max_tokens=14050,  # Azure conv ContextTokens
                   quantiles=_percentiles(29, 181, 207, 387, 396, 403, 703, 1020, 1071, 1130, 1189, 1315, 2734, 4083,
                                          4142)),
        output=dict(mean=211, max_tokens=1000,  # Azure conv GeneratedTokens
                    quantiles=_percentiles(16, 41, 54, 77, 85, 91, 103, 129, 177, 384, 395, 400, 424, 451, 601)),
        prefix_reuse=0.357,  # Mooncake conversation (Kimi chat): 0.357; Azure publishes no prefix data
        turn_gap_s=5.0, session_idle_s=600.0,  # modelling choice: a user reads and types between turns
    ),
    "code": dict(
        description="code completion: Azure OpenAI coding service, Nov 2023 (Azure LLM inference trace, code)",
        rate_rps=2.57,  # Azure code: 8,819 requests in 3,435.9 s
        burstiness=13.2,  # Azure code: CV of inter-arrival times 13.15 (bursts of completions, then idle minutes)
        rate_swing=0.0, swing_time_s=0.0,  # (its swings are those bursts: the renewal's idle gaps)
        input=dict(mean=2048, max_tokens=7437,  # Azure code ContextTokens
                   quantiles=_percentiles(17, 75, 147, 386, 578, 770, 1075, 1469, 1909, 2433, 2744, 3192, 5188, 7303,
                                          7436)),
        output=dict(mean=28, max_tokens=1899, min_tokens=6,  # Azure code GeneratedTokens
                    quantiles=_percentiles(6, 6, 7, 8, 9, 9, 11, 13, 16, 20, 24, 29, 55, 90, 251)),
        prefix_reuse=0.0,  # Azure code publishes no prefix data: independent completions, the no-reuse baseline
        turn_gap_s=0.0, session_idle_s=0.0,
    ),
    "long-context": dict(
        description="long-context chat: Kimi production conversations (Mooncake FAST'25 conversation trace)",
        rate_rps=3.28,  # Mooncake conversation: 7,980 requests in 2,433 s
        burstiness=1.0,  # Mooncake conversation: 3-s timestamp steps hide finer structure; jittered within steps, 1.01
        # jittered, its per-minute counts swing with a CV of 0.12 (0.10 beyond Poisson's; 0.07 over 5 minutes),
        # neighbouring minutes correlating at 0.21 (noisier than Azure's: a correlation time of 1-9 minutes); a
        # swing of 0.11 gives draws of its length 0.12 on average (16 seeds), neighbours at 0.4
        rate_swing=0.11, swing_time_s=120.0,
        input=dict(mean=12403, max_tokens=124847, min_tokens=891,  # Mooncake conversation input_length
                   quantiles=_percentiles(894, 901, 973, 1708, 2410, 3466, 5217, 7220, 9887, 13545, 15664, 18315,
                                          27969, 40417, 89867)),
        output=dict(mean=347, max_tokens=2000,  # Mooncake conversation output_length
                    quantiles=_percentiles(3, 10, 24, 99, 157, 216, 300, 356, 402, 452, 476, 510, 605, 709, 1167)),
        prefix_reuse=0.357,  # Mooncake conversation: 0.3566 at 16-token blocks (token hit ratio 0.3569)
        turn_gap_s=5.0, session_idle_s=600.0,  # modelling choice, as for chat
    ),
    "agent": dict(
        description="agent-like multi-turn traffic re-sending long, growing contexts: the lengths and prefix reuse of "
                    "Mooncake FAST'25's synthetic trace (built from public datasets with Poisson arrivals, not a "
                    "recorded agent trace)",
        rate_rps=3.91,  # Mooncake synthetic: 3,993 requests in 1,022 s
        burstiness=1.0,  # Mooncake synthetic: Poisson-generated arrivals (CV 1.01)
        rate_swing=0.0, swing_time_s=0.0,  # (generated at a constant rate: per-minute counts as Poisson's)
        input=dict(mean=15325, max_tokens=191378, min_tokens=13,  # Mooncake synthetic input_length
                   quantiles=_percentiles(16, 22, 30, 88, 277, 913, 4365, 11587, 16290, 19409, 23175, 28425, 38611,
                                          48905, 66456)),
        output=dict(mean=149, max_tokens=893,  # Mooncake synthetic output_length
                    quantiles=_percentiles(2, 2, 4, 8, 11, 16, 32, 69, 126, 210, 250, 289, 389, 519, 768)),
        prefix_reuse=0.651,  # Mooncake synthetic: 0.6510 at 16-token blocks (token hit ratio 0.6512)
        turn_gap_s=1.0, session_idle_s=120.0,  # modelling choice: tool results come back within seconds
    ),
}
DEFAULT_REQUESTS = 2000


# ---- how many requests this machine can simulate ----

# What simulating a request takes at least: the replay's peak heap a request, measured with tracemalloc over
# whole traces by `benchmarks/sim_memory.py` (BENCHMARKS.md, "Simulator memory"): 10.0 KB on Azure conv (19,366
# requests, 1,157 prompt tokens on average), 19.5 KB on Mooncake conversation (7,980 requests, 5,439). The
# smaller figure, so that a count refused could not have been simulated here whatever its prompts; the
# workload's block lists, which grow with the prompts, are counted apart (`BLOCK_ID_BYTES`).
SIMULATED_BYTES_PER_REQUEST = 10_000
# a prompt's block list holds an int64 id a block (`chain_blocks`), which the workload keeps while the simulator
# runs (agent, 1e6 requests: 6.8 GB of ids, and a peak RSS of 7.5 GB in `synthesize`)
BLOCK_ID_BYTES = 8


def _mean_tokens(lengths: LengthDist) -> float:
    return lengths.expected_mean() if isinstance(lengths, QuantileLengths) else float(np.mean(lengths.values))


def bytes_per_request(preset: Preset, block_tokens: int = SESSION_BLOCK_TOKENS) -> float:
    """About what a request of ``preset`` takes to synthesize and simulate, at least: `SIMULATED_BYTES_PER_REQUEST`
    and its prompt's block list (every prompt's counted: a request in no session has none)."""
    return SIMULATED_BYTES_PER_REQUEST + BLOCK_ID_BYTES * _mean_tokens(preset.input) / block_tokens


def max_requests(preset: Preset, block_tokens: int = SESSION_BLOCK_TOKENS) -> int | None:
    """The most requests of ``preset`` whose simulation fits in the memory available now; None if unknown."""
    available = available_memory_bytes()
    return None if available is None else int(available // bytes_per_request(preset, block_tokens))


def check_request_count(n: int, preset: Preset, block_tokens: int = SESSION_BLOCK_TOKENS) -> None:
    """Refuse, in one line and before anything is allocated, ``n`` requests whose simulation could not fit in
    this machine's memory (`--requests 100000000` had run for minutes, its memory growing, before failing)."""
    available = available_memory_bytes()
    if available is None:
        return
    each = bytes_per_request(preset, block_tokens)
    if n * each <= available:
        return
    blocks = "" if block_tokens == SESSION_BLOCK_TOKENS else f", {block_tokens}-token blocks"
    raise ValueError(f"--requests {n:,}: {preset.name} requests take about {each / 1e3:.1f} KB each to simulate"
                     f"{blocks}, {n * each / 1e9:,.1f} GB in all, more than the {available / 1e9:.1f} GB of "
                     f"memory available here; at most {int(available // each):,} requests fit (in Python: "
                     "requests=)")


def check_workers_fit(requests: int, workers: int) -> None:
    """Refuse, in one line and before any worker starts, ``workers`` worker processes (``--jobs``) that could not
    all simulate ``requests`` requests in this machine's memory: each holds its own simulation of them (a worker
    the kernel kills for memory loses its trial and slows the rest)."""
    available = available_memory_bytes()
    if available is None or workers <= 1:
        return
    each = requests * SIMULATED_BYTES_PER_REQUEST  # (the workload itself is the parent's, inherited by the fork)
    if workers * each <= available:
        return
    fit = int(available // each)
    instead = (f"at most {fit} fit (in Python: n_jobs=)" if fit >= 1 else
               "not even one fits: give fewer requests")
    raise ValueError(f"--jobs {workers}: each worker process simulates the search's {requests:,} requests, about "
                     f"{each / 1e9:,.2f} GB each and {workers * each / 1e9:,.2f} GB in all, more than the "
                     f"{available / 1e9:.1f} GB of memory available here; {instead}")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    rate_rps: float
    burstiness: float
    rate_swing: float  # `swinging_arrivals`: the log-rate's standard deviation, and its correlation time
    swing_time_s: float
    input: LengthDist
    output: LengthDist
    prefix_reuse: float
    turn_gap_s: float
    session_idle_s: float


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"workload preset {name!r}: unknown (known: {', '.join(PRESETS)})")
    params = dict(PRESETS[name])
    return Preset(name=name, **{**params, "input": QuantileLengths(**params["input"]),
                                "output": QuantileLengths(**params["output"])})


def synthesize(preset: str | Preset, *, requests: int | None = None, seed: int = 0, rate_rps: float | None = None,
               burstiness: float | None = None, block_tokens: int = SESSION_BLOCK_TOKENS) -> Workload:
    """A seeded synthetic workload. Arrivals, input lengths, output lengths and sessions draw from separate
    streams, so changing the rate leaves the lengths as they were."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    n = DEFAULT_REQUESTS if requests is None else requests
    rate_rps = preset.rate_rps if rate_rps is None else rate_rps
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise ValueError(f"requests must be a whole number, got {n!r}")
    if n < 1:
        raise ValueError(f"requests must be >= 1, got {n}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, numbers.Integral) or block_tokens < 1:
        raise ValueError(f"block_tokens must be a whole number >= 1, got {block_tokens!r}")
    check_request_count(n, preset, block_tokens)  # (before anything is drawn: 1e8 requests took minutes and GBs)
    # any burstiness is drawn, with a note when the draw falls short: refusing it broke small bursty workloads that
    # benchmarks replay (12 requests at 4), and a few requests of code-like traffic are still wanted
    burstiness = preset.burstiness if burstiness is None else burstiness
    streams = np.random.SeedSequence(seed).spawn(4)
    rng_arrival, rng_input, rng_output, rng_session = (np.random.default_rng(stream) for stream in streams)
    arrival_s = swinging_arrivals(n, rate_rps, burstiness, preset.rate_swing, preset.swing_time_s, rng_arrival)
    input_tokens = preset.input.sample(rng_input, n)
    output_tokens = preset.output.sample(rng_output, n)
    follow_u = rng_session.random(n)
    session_args = dict(turn_gap_s=preset.turn_gap_s, idle_s=preset.session_idle_s)
    follow_prob = calibrate_follow_prob(arrival_s, input_tokens, follow_u, preset.prefix_reuse,
                                        block_tokens=block_tokens, **session_args)
    prev_turn = wire_sessions(arrival_s, input_tokens, follow_u, follow_prob, **session_args)
    block_offsets, block_ids = chain_blocks(input_tokens, prev_turn, block_tokens)
    source = (f"preset:{preset.name} requests={n} seed={seed} rate_rps={rate_rps:g} burstiness={burstiness:g} "
              f"block_tokens={block_tokens}")
    reached = session_reuse(input_tokens, prev_turn, block_tokens)
    notes = () if reached >= preset.prefix_reuse - 0.05 else (
        f"prefix reuse {reached:.3f} as generated (before any length cap) falls short of the preset's "
        f"{preset.prefix_reuse:g}: too few requests ({n}) for sessions to grow; use more",)
    notes += burstiness_notes(arrival_s, burstiness)
    return Workload(name=preset.name, arrival_s=arrival_s, input_tokens=input_tokens, output_tokens=output_tokens,
                    block_offsets=block_offsets, block_ids=block_ids, session_ids=session_numbers(prev_turn),
                    request_ids=np.arange(n), block_tokens=block_tokens, source=source,
                    generated_arrivals=True, requested_burstiness=burstiness, notes=notes)
