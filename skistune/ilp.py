"""Integer and linear programs (PuLP + CBC) for the structured parts of a trial.

Optuna picks the categorical and global knobs; these programs fill in what has structure:

    solve_layer_bits      key/value bits per layer: fewest KV bytes per token under a quality budget
    solve_tier_fractions  FlexGen-style split of the KV over device/host/disk: shortest step time under
                          tier capacities and read bandwidths, with or without prefetch overlap

Inputs are plain numbers and dicts (the quality and hardware profiles supply them), so each program
can be checked against brute force on small cases. An infeasible program is a result
(``status == "infeasible"``), never an exception: in a search it is an ordinary outcome (prune the
trial), while malformed inputs raise ``ValueError`` saying what is missing. ``SolverStats`` counts
calls and solve times so the optimizer can report them.
"""
from __future__ import annotations

import functools
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping

import pulp

BitsPair = tuple[int, int]  # (key_bits, value_bits)
DEFAULT_ALLOWED: tuple[BitsPair, ...] = ((16, 16), (8, 8), (8, 4), (4, 4), (4, 2), (2, 2))
FULL_PRECISION: BitsPair = (16, 16)
DEVICE_TIER = "device"
# Tie-break weight: among splits with the same step time, move the fewest bytes (keeps KV on the
# device while transfers are still hidden under compute). Both step-time forms grow with the transfer
# time, so this never trades step time for traffic.
_TRAFFIC_TIE_BREAK = 1e-6


@dataclass
class SolverStats:
    """How often one program ran and how long CBC took (wall time including PuLP's model write-out)."""

    calls: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    by_status: Counter = field(default_factory=Counter)

    def record(self, solve_s: float, status: str) -> None:
        self.calls += 1
        self.total_s += solve_s
        self.max_s = max(self.max_s, solve_s)
        self.by_status[status] += 1

    @property
    def mean_s(self) -> float:
        return self.total_s / self.calls if self.calls else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"calls": self.calls, "total_s": self.total_s, "mean_s": self.mean_s,
                "max_s": self.max_s, "by_status": dict(self.by_status)}


@dataclass(frozen=True)
class LayerBitsSolution:
    """Bits per layer in layer order (``BitwidthConfig.layer_bits`` form); ``None`` fields when the
    budget cannot be met even at full precision."""

    layer_bits: tuple[BitsPair, ...] | None
    kv_bytes_per_token: float | None  # summed over layers
    predicted_loss: float | None  # summed per-layer sensitivities of the chosen pairs
    solve_s: float
    status: str  # "optimal", "infeasible", or CBC's status in lower case

    @property
    def feasible(self) -> bool:
        return self.status == "optimal"


@dataclass(frozen=True)
class TierSolution:
    """Fraction of the KV held in each tier and the predicted per-step time; ``None`` fields when the
    tiers cannot hold the KV."""

    fractions: dict[str, float] | None
    step_s: float | None
    transfer_s: float | None  # reads from the non-device tiers per step
    solve_s: float
    status: str

    @property
    def feasible(self) -> bool:
        return self.status == "optimal"


@functools.lru_cache(maxsize=1)
def _cbc_on_path() -> bool:
    return bool(pulp.COIN_CMD(msg=False).available())


def _solve(problem: pulp.LpProblem) -> tuple[str, float]:
    """CBC, silent. PuLP 3.3 deprecates its bundled CBC (PULP_CBC_CMD) in favour of a CBC on the PATH
    (``pip install pulp[cbc]``); use that when present, else the bundled one without the warning."""
    start = time.perf_counter()
    if _cbc_on_path():
        problem.solve(pulp.COIN_CMD(msg=False))
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="PULP_CBC_CMD is deprecated", category=DeprecationWarning)
            problem.solve(pulp.PULP_CBC_CMD(msg=False))
    return pulp.LpStatus[problem.status].lower(), time.perf_counter() - start


def _record(stats: SolverStats | None, solve_s: float, status: str) -> None:
    if stats is not None:
        stats.record(solve_s, status)


# ---- bits per layer -------------------------------------------------------------------------------
def _layer_losses(sensitivity: Mapping[tuple[int, int, int], float], n_layers: int,
                  allowed: Iterable[BitsPair]) -> dict[tuple[int, BitsPair], float]:
    """Loss of every (layer, pair). Full precision is the reference, so a missing (16, 16) entry is 0;
    any other missing entry is an error (guessing a loss would hide an unmeasured setting)."""
    losses, missing = {}, []
    for layer in range(n_layers):
        for pair in allowed:
            key = (layer, *pair)
            if key in sensitivity:
                losses[layer, pair] = float(sensitivity[key])
            elif pair == FULL_PRECISION:
                losses[layer, pair] = 0.0
            else:
                missing.append(key)
    if missing:
        raise ValueError(f"sensitivity: no loss for (layer, key_bits, value_bits) {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}; measure them or remove the pairs from allowed")
    return losses


def _check_layer_inputs(bytes_per_token: Mapping[BitsPair, float], n_layers: int,
                        allowed: tuple[BitsPair, ...]) -> None:
    if n_layers < 1:
        raise ValueError(f"n_layers: {n_layers} must be at least 1")
    if not allowed:
        raise ValueError("allowed: empty; give at least one (key_bits, value_bits) pair")
    missing = [p for p in allowed if p not in bytes_per_token]
    if missing:
        raise ValueError(f"bytes_per_token: no size for pairs {missing}; add them or remove them from allowed")


def _layer_bits_program(losses: Mapping[tuple[int, BitsPair], float], bytes_per_token: Mapping[BitsPair, float],
                        quality_budget: float, n_layers: int, allowed: tuple[BitsPair, ...]):
    """x[l, c] = 1 when layer l uses pair c: one pair per layer, total loss within the budget."""
    problem = pulp.LpProblem("layer_bits", pulp.LpMinimize)
    x = {(l, c): problem.add_variable(f"x_{l}_{c[0]}_{c[1]}", cat="Binary") for l in range(n_layers) for c in allowed}
    kv_bytes = pulp.lpSum(bytes_per_token[c] * v for (l, c), v in x.items())
    loss = pulp.lpSum(losses[l, c] * v for (l, c), v in x.items())
    problem += kv_bytes
    for l in range(n_layers):
        problem += pulp.lpSum(x[l, c] for c in allowed) == 1, f"one_pair_layer_{l}"
    problem += loss <= quality_budget, "quality_budget"
    return problem, x, kv_bytes, loss


def solve_layer_bits(sensitivity: Mapping[tuple[int, int, int], float], bytes_per_token: Mapping[BitsPair, float],
                     quality_budget: float, n_layers: int, allowed: Iterable[BitsPair] = DEFAULT_ALLOWED, *,
                     stats: SolverStats | None = None) -> LayerBitsSolution:
    """Choose (key_bits, value_bits) per layer to minimise KV bytes per token subject to
    ``sum of per-layer losses <= quality_budget``.

    ``sensitivity[(layer, key_bits, value_bits)]`` is the quality loss of quantizing that layer alone
    (from the quality profile); ``bytes_per_token[(key_bits, value_bits)]`` the bytes one token costs in
    one layer. Among choices of equal size the one with the least loss wins (a second, lexicographic
    solve). An unreachable budget returns ``status="infeasible"`` without calling the solver.
    """
    allowed = tuple(dict.fromkeys(tuple(p) for p in allowed))
    _check_layer_inputs(bytes_per_token, n_layers, allowed)
    losses = _layer_losses(sensitivity, n_layers, allowed)
    floor = sum(min(losses[l, c] for c in allowed) for l in range(n_layers))
    if floor > quality_budget:
        _record(stats, 0.0, "infeasible")
        return LayerBitsSolution(None, None, None, 0.0, "infeasible")
    problem, x, kv_bytes, loss = _layer_bits_program(losses, bytes_per_token, quality_budget, n_layers, allowed)
    status, solve_s = _solve(problem)
    if status == "optimal":
        # Second stage: hold the byte optimum (with a relative slack for CBC's tolerance), least loss.
        best_bytes = pulp.value(kv_bytes)
        problem += kv_bytes <= best_bytes + 1e-9 * max(1.0, abs(best_bytes)), "best_bytes"
        problem.setObjective(loss)
        status, second_s = _solve(problem)
        solve_s += second_s
    _record(stats, solve_s, status)
    if status != "optimal":
        return LayerBitsSolution(None, None, None, solve_s, status)
    chosen = tuple(next(c for c in allowed if x[l, c].value() > 0.5) for l in range(n_layers))
    return LayerBitsSolution(chosen, sum(bytes_per_token[c] for c in chosen),
                             sum(losses[l, c] for l, c in enumerate(chosen)), solve_s, status)


# ---- fractions of KV per tier ---------------------------------------------------------------------
def _check_tier_inputs(kv_bytes: float, capacities: Mapping[str, float], read_bytes_per_s: Mapping[str, float],
                       compute_s: float, device_tier: str) -> None:
    if kv_bytes < 0 or compute_s < 0:
        raise ValueError(f"kv_bytes ({kv_bytes}) and compute_s ({compute_s}) must be non-negative")
    if device_tier not in capacities:
        raise ValueError(f"capacities: no {device_tier!r} tier (tiers: {', '.join(capacities)}); "
                         "name the compute device's pool or pass device_tier=")
    for tier, cap in capacities.items():
        if cap < 0:
            raise ValueError(f"capacities[{tier!r}]: {cap} bytes is negative")
        if tier != device_tier and not read_bytes_per_s.get(tier, 0) > 0:
            raise ValueError(f"read_bytes_per_s[{tier!r}]: missing or not positive; give the tier's "
                             "measured read bandwidth to the device")


def _tier_program(kv_bytes: float, capacities: Mapping[str, float], read_bytes_per_s: Mapping[str, float],
                  compute_s: float, overlap: bool, device_tier: str):
    """f_t: share of the KV in tier t. Transfers read every non-device share once per step."""
    problem = pulp.LpProblem("tier_fractions", pulp.LpMinimize)
    f = {t: problem.add_variable(f"f_{i}", lowBound=0, upBound=1) for i, t in enumerate(capacities)}
    problem += pulp.lpSum(f.values()) == 1, "all_kv_placed"
    for i, (t, cap) in enumerate(capacities.items()):
        problem += kv_bytes * f[t] <= cap, f"capacity_{i}"
    transfer = pulp.lpSum(kv_bytes / read_bytes_per_s[t] * f[t] for t in capacities if t != device_tier)
    if overlap:
        # Epigraph of max(compute, transfer): step >= both, minimised, so it equals the larger.
        step = problem.add_variable("step_s", lowBound=0)
        problem += step >= compute_s, "step_covers_compute"
        problem += step >= transfer, "step_covers_transfer"
    else:
        step = compute_s + transfer
    problem += step + _TRAFFIC_TIE_BREAK * transfer
    return problem, f, step, transfer


def solve_tier_fractions(kv_bytes: float, capacities: Mapping[str, float], read_bytes_per_s: Mapping[str, float],
                         compute_s: float, overlap: bool, *, device_tier: str = DEVICE_TIER,
                         stats: SolverStats | None = None) -> TierSolution:
    """Split ``kv_bytes`` over the tiers (FlexGen-style LP) to minimise the step time.

    ``step = max(compute_s, transfer_s)`` when prefetch overlaps transfers with compute, else
    ``compute_s + transfer_s``, where ``transfer_s = sum over non-device tiers of f_t * kv_bytes / bw_t``.
    Each tier holds at most its capacity; the device tier costs no transfer, so it fills first. If the
    tiers together cannot hold the KV the result is ``status="infeasible"`` (no solve).
    """
    _check_tier_inputs(kv_bytes, capacities, read_bytes_per_s, compute_s, device_tier)
    if sum(capacities.values()) < kv_bytes:
        _record(stats, 0.0, "infeasible")
        return TierSolution(None, None, None, 0.0, "infeasible")
    problem, f, step, transfer = _tier_program(kv_bytes, capacities, read_bytes_per_s, compute_s, overlap,
                                               device_tier)
    status, solve_s = _solve(problem)
    _record(stats, solve_s, status)
    if status != "optimal":
        return TierSolution(None, None, None, solve_s, status)
    fractions = {t: max(0.0, v.value() or 0.0) for t, v in f.items()}
    return TierSolution(fractions, float(pulp.value(step)), float(pulp.value(transfer) or 0.0), solve_s, status)
