"""`QualityProfile`: measured quality losses of a real model and the combination model that predicts the loss
of any config from them.

Loss unit. For each measured config and profile window, ``d = mean NLL(config) - mean NLL(full)`` over the
window's positions, every one predicted through the compressed cache of the text before it (prefill chunks
and decode steps alike), as in the perplexity evaluations of StreamingLLM, H2O and KIVI. SnapKV compresses
only when the prompt ends, so over the prompt it loses nothing: its ``d`` is read on the decoded
continuation (the tokens a served request generates after its prompt) instead (`loss_metric`). A config's
relative perplexity increase on a window is ``exp(d) - 1``; the mean-window loss is ``exp(mean_w d) - 1``
(windows are of equal length), the worst-window loss ``max_w exp(d_w) - 1``. A mean-window floor is
checked against ``exp(mean_w d + t95 * sd_w(d) / sqrt(n)) - 1``, the one-sided 95% upper bound of the mean
from the spread between windows, and a worst-window floor against the larger of the worst profile window and
``exp(mean_w d + t95 * sd_w(d) * sqrt(1 + 1/n)) - 1``, the one-sided 95% prediction bound for one more
window: the floors are meant to hold on text the profile never saw.

Combination model (no fitted parameters; its structure was revised after the first 25 joint configs of
the grid, whose 6 later ones were held-out checks of it, see BENCHMARKS.md, and again, for the sanity
relations below, after all 31: none is held out from that last revision):
- keys and values add: ``d_bits = d_key(key bits, fp window) + r + d_value(value bits, group, fp window)``,
  each from its single-side grid, where ``r`` is what compactions add to the keys' loss under the config's
  policy (measured per policy, key bits and fp window: `_requantization`; 0 without eviction); per-layer bits weight
  each layer by its measured sensitivity (its share of the summed one-layer-at-2-bits losses), so a
  uniform assignment predicts exactly the uniform measurement;
- eviction: the policy's loss at the budget fraction (linear between measured fractions, to 0 at 1.0; each
  window at least what it lost at any larger measured budget, `_evict_curve`), at the largest measured sink
  count not above the config's (0 or 4), plus what each variant adds to it (recent window 16/256,
  interpolated in log2 of the window and, above the reference budget, read at the share of the budget it
  takes, see `_recent_effect`; pyramid schedule): the variants were measured at two budgets (0.25 and 0.5),
  and their differences to the policy's loss there are interpolated between them, faded to nothing at a
  budget of 1.0 above them and, below them, grown with the policy's loss where they add loss, held where
  they remove it (`_across_references`); each window of the sum is held at or above the lowest loss any
  of the policy's measurements showed on it (their noise: eviction does not beat the full cache), and the
  result is made non-increasing in the budget (`_evict_envelope`);
- every part is read on the tokens the config's loss is read on (`loss_metric`: SnapKV's decoded tokens);
- bits and eviction add in log-perplexity: ``d = d_bits + d_evict`` per window.
Axes are read conservatively where the grid has no point: a full-precision window between measured ones
is interpolated, above the largest measured one it counts as that one; a group size without a measurement
takes the next larger measured group (larger groups lose more). A budget below the smallest measured
fraction, or sinks below the smallest measured count, cannot be predicted: the loss is infinite, so no
quality floor admits it.

Passkey retrieval (share of the full cache's accuracy kept): bits use the measurement at the lowest bits any
layer uses (or the next lower measured bits), eviction the measurement at the largest measured budget not
above the config's; the two multiply.

Budgets in tokens are read as a fraction of the context they apply to: the workload's (the optimizer
passes its 90th-percentile request context, prompt plus output) or, without one, the profile's window. Models other than the profile's use it as a proxy
(``QualityLoss.basis``), layers mapped by relative depth.
"""
from __future__ import annotations

import dataclasses

import bisect
import json
import math
import statistics
from pathlib import Path
from typing import Any

from skistune.config import KVConfig
from skistune.objectives import NO_LOSS, QualityLoss, quantized_changes, structural_changes
from skistune.quality.grid import INTERACTION_FRACTION, REFERENCE_SINKS

FORMAT = "skistune-quality-profile"
VERSION = 1
FULL_BITS = 16
DEFAULT_RECENT = 64
ALL_POSITIONS, CONTINUATION = "nll_all_positions", "nll"  # a measurement's per-window mean NLLs
UNKNOWN = QualityLoss(math.inf, math.inf, 0.0, basis="outside the measured grid")
# The combination model's goal on a joint config: its predicted mean-window loss within 20% of the measured
# one, or within 0.5 percentage points where that is more (a loss near zero is mostly the windows' noise).
GOAL_RELATIVE, GOAL_ABSOLUTE = 0.2, 0.005
GOAL_RULE = (f"|predicted - measured| <= max({GOAL_RELATIVE:.0%} of measured, "
             f"{100 * GOAL_ABSOLUTE:g} percentage points)")


def loss_metric(policy: str | None) -> str:
    """Which tokens a measurement's loss is read on: every position (the text streamed through the
    compressed cache), except for SnapKV, which compresses only at the prompt's end and so is read on the
    decoded continuation alone (fewer tokens: a noisier figure, but not one that hides its loss)."""
    return CONTINUATION if policy == "snapkv" else ALL_POSITIONS


def knob_key(knobs: dict) -> str:
    """A measurement's identity in the profile file: its knobs as sorted JSON."""
    return json.dumps(knobs, sort_keys=True, separators=(",", ":"))


def _upper_margin(deltas: list[float], new_window: bool = False) -> float:
    """One-sided 95% Student-t margin above the mean of per-window values: for the mean itself, or (with
    ``new_window``) for one more window (a prediction interval); 0 with one window."""
    n = len(deltas)
    if n < 2:
        return 0.0
    from scipy.stats import t

    spread = math.sqrt(1 + 1 / n) if new_window else 1 / math.sqrt(n)
    return float(t.ppf(0.95, n - 1)) * statistics.stdev(deltas) * spread


def _raise_to_larger_budgets(ys: list[list[float]]) -> None:
    """In place, per window: each budget's loss raised to the largest at any larger budget (``ys`` in budget
    order): the upper monotone envelope, so that a larger budget never predicts more loss."""
    for i in range(len(ys) - 2, -1, -1):
        ys[i] = [max(a, b) for a, b in zip(ys[i], ys[i + 1])]


def _interp(x: float, xs: list[float], ys: list[list[float]]) -> list[float] | None:
    """Per-window values at ``x``, linear between measured points; None below the first point."""
    if x < xs[0] - 1e-12:
        return None
    i = bisect.bisect_right(xs, x + 1e-12) - 1
    if i == len(xs) - 1:
        return list(ys[i])
    t = (x - xs[i]) / (xs[i + 1] - xs[i])
    return [a + t * (b - a) for a, b in zip(ys[i], ys[i + 1])]


def _check_shape(data: dict, path: str) -> None:
    """The structure a profile's readers rely on, named where it breaks (one line, not a traceback): a count
    of layers, measurements as objects of number lists, passkey results as lists of found flags."""
    def bad(where: str, what: str) -> ValueError:
        return ValueError(f"{path}: {where}: expected {what}")

    n_layers = data.get("n_layers", 1)  # (missing: `load` names it)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise bad("n_layers", f"a positive number of layers, got {n_layers!r}")
    n_windows = _declared_windows(data, bad)
    for section, lists in (("perplexity", (ALL_POSITIONS, CONTINUATION)), ("needle", ("found",))):
        entries = data.get(section, {})
        if not isinstance(entries, dict):
            raise bad(section, f"an object of measurements, got {type(entries).__name__}")
        for key, entry in entries.items():
            if not isinstance(entry, dict):
                raise bad(f"{section}[{key!r}]", f"an object, got {type(entry).__name__}")
            for name in lists:
                if section == "perplexity" and name not in entry:  # (every loss is read on one or the other)
                    raise bad(f"{section}[{key!r}].{name}", "a list of per-window NLLs, got none")
                values = entry.get(name, [])
                if not isinstance(values, list) or not all(
                        isinstance(v, (int, float)) and not isinstance(v, str) for v in values):
                    raise bad(f"{section}[{key!r}].{name}", "a list of numbers")
                if section == "perplexity":
                    _check_nll(values, n_windows, lambda what: bad(f"perplexity[{key!r}].{name}", what))
            if section == "needle" and not entry.get("found"):
                raise bad(f"needle[{key!r}].found", "at least one passkey result")


def _declared_windows(data: dict, bad) -> int | None:
    """How many profile windows each perplexity measurement scored (``protocol.windows``, as `skistune
    quality` writes it). A file that does not say is held to its full-precision reference's count, since
    every loss is paired window by window with the reference; None when neither says."""
    protocol = data.get("protocol", {})
    if not isinstance(protocol, dict):
        raise bad("protocol", f"an object, got {type(protocol).__name__}")
    if "windows" not in protocol:
        full = data.get("perplexity", {}).get(knob_key({})) if isinstance(data.get("perplexity"), dict) else None
        values = full.get(ALL_POSITIONS) if isinstance(full, dict) else None
        return len(values) if isinstance(values, list) and values else None
    n = protocol["windows"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise bad("protocol.windows", f"a positive number of windows, got {n!r}")
    return n


def _check_nll(values: list, n_windows: int | None, bad) -> None:
    """A measurement's per-window mean NLLs: one per window (the model pairs them window by window with the
    reference's; a short list would silently drop windows from every mean and bound), each finite (a NaN
    poisons every prediction read from it) and non-negative (a negative log-likelihood is no measurement)."""
    if n_windows is not None and len(values) != n_windows:
        raise bad(f"one value per window ({n_windows}), got {len(values)}")
    if not values:  # (no window: every mean over windows divides by zero)
        raise bad("at least one per-window NLL, got none")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not math.isfinite(v):
            raise bad(f"finite numbers, got {v!r} at window {i}")
        if v < 0:
            raise bad(f"non-negative NLLs, got {v!r} at window {i}")


class QualityProfile:
    """A quality profile file's measurements and the predictions made from them."""

    def __init__(self, data: dict, path: str | None = None) -> None:
        if data.get("format") != FORMAT:
            raise ValueError(f"{path or 'quality profile'}: not a skistune quality profile (format {data.get('format')!r})")
        if data.get("version") != VERSION:
            raise ValueError(f"{path or 'quality profile'}: quality profile version {data.get('version')!r}, this "
                             f"skistune reads version {VERSION}: measure again with `skistune quality`")
        self.data = data
        self.path = path
        self.model = data["model"]
        self.n_layers = data["n_layers"]
        self.window_tokens = data["corpus"]["window_tokens"]
        ppl = data["perplexity"]
        if knob_key({}) not in ppl:
            raise ValueError(f"{path or 'quality profile'}: no full-precision reference measurement")
        full = ppl[knob_key({})]
        self._full = full[ALL_POSITIONS]
        # per kind: (knobs, per-window deltas on each metric the entry has)
        self._by_kind: dict[str, list[tuple[dict, dict[str, list[float]]]]] = {}
        for entry in ppl.values():
            deltas = {m: [c - f for c, f in zip(entry[m], full[m])] for m in (ALL_POSITIONS, CONTINUATION)
                      if m in entry and m in full}
            self._by_kind.setdefault(entry["kind"], []).append((entry["knobs"], deltas))
        self._layer_share = self._layer_shares()
        self._envelopes: dict[tuple, tuple[list[float], list[list[float]]] | None] = {}
        needle = data.get("needle", {})
        full_needle = needle.get(knob_key({}))
        self._needle_full = sum(full_needle["found"]) / len(full_needle["found"]) if full_needle else None
        self._needle = {key: sum(e["found"]) / len(e["found"]) for key, e in needle.items()}

    # ---- files -------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> "QualityProfile":
        from skistune.profile.profile import FORMAT as HARDWARE_FORMAT
        from skistune.profile.profile import read_json_file

        data = read_json_file(path, "quality profile")
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a quality profile (expected a JSON object)")
        if data.get("format") == HARDWARE_FORMAT:  # (the other kind of profile file)
            raise ValueError(f"{path}: a hardware profile, not a quality profile: print it with "
                             f"`skistune profile --show {path}`")
        _check_shape(data, str(path))
        try:
            return cls(data, str(path))
        except KeyError as exc:
            raise ValueError(f"{path}: quality profile lacks {exc}") from None
        except (TypeError, AttributeError, IndexError, ZeroDivisionError) as exc:  # (a shape not checked above)
            raise ValueError(f"{path}: quality profile is malformed ({type(exc).__name__}: {exc})") from None

    # ---- single-knob tables ---------------------------------------------------------------------------
    def _table(self, kind: str, metric: str | None = None) -> list[tuple[dict, list[float]]]:
        """A kind's measurements, each as its per-window deltas read on ``metric`` (default: the entry's own,
        `loss_metric` of its policy)."""
        return [(knobs, deltas[metric or loss_metric(knobs.get("eviction.policy"))])
                for knobs, deltas in self._by_kind.get(kind, [])]

    def _layer_shares(self) -> list[float]:
        """Each layer's share of the summed one-layer sensitivities (uniform when not measured)."""
        losses = [0.0] * self.n_layers
        measured = False
        for knobs, deltas in self._table("layer"):
            pairs = knobs["bitwidth.layer_bits"]
            probed = [i for i, p in enumerate(pairs) if tuple(p) != (FULL_BITS, FULL_BITS)]
            for layer in probed:  # a probe of several layers gives each an equal part
                losses[layer] = max(0.0, sum(deltas) / len(deltas)) / len(probed)
            measured = True
        total = sum(losses)
        if not measured or total <= 0:
            return [1.0 / self.n_layers] * self.n_layers
        return [x / total for x in losses]

    def _side(self, side: str, bits: int, group: int, fp_window: int, metric: str) -> list[float] | None:
        """Per-window loss of one side (``key`` or ``value``) at ``bits`` over every layer, read on ``metric``."""
        if bits == FULL_BITS:
            return [0.0] * len(self._full)
        rows = [(k, d) for k, d in self._table(side, metric) if k[f"bitwidth.{side}_bits"] == bits]
        if side == "value":
            groups = sorted({k["bitwidth.group_size"] for k, _ in rows})
            if not groups:
                return None
            larger = [g for g in groups if g >= group]
            pick = larger[0] if larger else groups[-1]
            rows = [(k, d) for k, d in rows if k["bitwidth.group_size"] == pick]
        points = sorted((k["bitwidth.full_precision_window"], d) for k, d in rows)
        if not points:
            return None
        return _interp(fp_window, [float(w) for w, _ in points], [d for _, d in points])

    def shares(self, n_layers: int) -> list[float]:
        """Each of ``n_layers`` layers' share of the sensitivity (a model of another depth takes the profile
        layer at the same relative depth; the shares are renormalised to sum to 1)."""
        if n_layers == self.n_layers:
            return list(self._layer_share)
        mapped = [self._layer_share[round(l * (self.n_layers - 1) / max(1, n_layers - 1))] for l in range(n_layers)]
        total = sum(mapped)
        return [x / total for x in mapped] if total > 0 else [1.0 / n_layers] * n_layers

    def _pair(self, pair: tuple[int, int], config: KVConfig) -> list[float] | None:
        """Keys and values at ``pair`` bits, read on the tokens the config's loss is read on (`loss_metric`):
        a SnapKV config's loss is its decoded continuation's, so its bits part must be too. Under eviction
        the keys lose more by the measured compaction interaction (`_requantization`)."""
        bw, policy = config.bitwidth, config.eviction.policy
        metric = loss_metric(policy)
        k = self._side("key", pair[0], bw.group_size, bw.full_precision_window, metric)
        v = self._side("value", pair[1], bw.group_size, bw.full_precision_window, metric)
        if k is None or v is None:
            return None
        extra = self._requantization(policy, pair[0], bw.full_precision_window, metric)
        return [a + x + b for a, x, b in zip(k, extra, v)]

    def _requantization(self, policy: str, key_bits: int, fp_window: int, metric: str) -> list[float]:
        """Per-window NLL that keys at ``key_bits`` lose under ``policy`` beyond the two knobs' own losses
        (0 without eviction, at 16 bits, or where no key-evict point was measured). A compaction moves the
        kept tokens to new slots and re-quantizes every packed block it rewrites; keys are quantized per
        channel over a block's tokens, so a block whose tokens changed gets a new grid, and a kept key gains
        rounding error at every compaction it survives. Values (per token) keep their grid.

        Read from the key-evict points (keys alone under the policy at `INTERACTION_FRACTION`, at the
        full-precision windows of `grid.INTERACTION_WINDOWS`) at the measured bits nearest at or below
        ``key_bits`` (else the lowest above, scaled by the two bits' own key losses): their excess over both
        knobs' own losses, linear between the measured windows and held outside them, and the same at every
        budget (2-bit keys with 128 full-precision tokens gained 0.048 NLL under H2O at budgets 0.5 and 0.75
        alike). The window changes the excess unlike the keys' own loss: 128 tokens cut 2-bit keys' own
        loss to a third, their excess under TOVA and StreamingLLM hardly at all."""
        zero = [0.0] * len(self._full)
        if policy == "none" or key_bits == FULL_BITS:
            return zero
        probes: dict[int, dict[int, list[float]]] = {}
        for k, d in self._table("key-evict", metric):
            if k["eviction.policy"] == policy:
                probes.setdefault(k["bitwidth.key_bits"], {})[k.get("bitwidth.full_precision_window", 0)] = d
        # (the measurement itself, not its monotone envelope: the excess is what the probe lost beyond it)
        evict = self._evict_at(policy, REFERENCE_SINKS, INTERACTION_FRACTION, monotone=False)
        if not probes or evict is None:
            return zero
        below = [b for b in probes if b <= key_bits]
        bits = max(below) if below else min(probes)
        windows = sorted(probes[bits])
        excess = []
        for w in windows:
            key = self._side("key", bits, 0, w, metric)
            if key is None:
                return zero
            excess.append([p - k - e for p, k, e in zip(probes[bits][w], key, evict)])
        x = _interp(min(max(fp_window, windows[0]), windows[-1]), [float(w) for w in windows], excess)
        if bits != key_bits:  # bits without a point: the same share of their own keys' loss
            mine, theirs = (self._side("key", b, 0, fp_window, metric) for b in (key_bits, bits))
            scale = sum(mine) / sum(theirs) if mine is not None and theirs is not None and sum(theirs) > 0 else 0.0
            x = [max(0.0, scale) * v for v in x]
        return x if sum(x) > 0 else zero

    def _bits(self, config: KVConfig) -> list[float] | None:
        bw = config.bitwidth
        if bw.layer_bits is None:
            return self._pair((bw.key_bits, bw.value_bits), config)
        shares = self.shares(len(bw.layer_bits))
        total = [0.0] * len(self._full)
        cache: dict[tuple[int, int], list[float] | None] = {}
        for share, pair in zip(shares, map(tuple, bw.layer_bits)):
            if pair not in cache:
                cache[pair] = self._pair(pair, config)
            if cache[pair] is None:
                return None
            total = [t + share * x for t, x in zip(total, cache[pair])]
        return total

    def layer_sensitivity(self, config: KVConfig, n_layers: int,
                          pairs) -> dict[tuple[int, int, int], float] | None:
        """``{(layer, key_bits, value_bits): mean NLL increase}`` of each layer alone at each pair (at the
        config's group size and full-precision window), for the per-layer bits program; None when a pair
        is outside the grid. Summed over layers, an assignment gives exactly the predicted bits loss."""
        shares = self.shares(n_layers)
        out = {}
        for pair in pairs:
            deltas = self._pair(tuple(pair), config)
            if deltas is None:
                return None
            mean = sum(deltas) / len(deltas)
            for layer, share in enumerate(shares):
                out[layer, *pair] = share * mean
        return out

    def evict_mean_delta(self, config: KVConfig, context_tokens: int | None = None) -> float:
        """The eviction part of the predicted loss, as mean NLL increase (infinite outside the grid)."""
        deltas = self._evict(config, context_tokens)
        return math.inf if deltas is None else sum(deltas) / len(deltas)

    def digest(self) -> str:
        """Identifies the measurements (a study resumed with another profile is another problem)."""
        import hashlib

        return hashlib.sha256(json.dumps(self.data["perplexity"], sort_keys=True).encode()).hexdigest()[:16]

    def fraction(self, config: KVConfig, context_tokens: int | None = None) -> float:
        """The budget as a fraction of the context: a token budget over ``context_tokens`` (the workload's
        context length), or over the profile's window length when none is given."""
        ev = config.eviction
        if ev.budget_fraction is not None:
            return ev.budget_fraction
        return min(1.0, ev.budget_tokens / (context_tokens or self.window_tokens))

    def _evict_curve(self, policy: str, sinks: int,
                     monotone: bool = True) -> tuple[list[float], list[list[float]]] | None:
        """The policy's measured per-window losses by budget fraction (with sinks ``sinks``), ending at 0 at a
        budget of the whole context. With ``monotone`` (every prediction) each window's loss is the upper
        monotone envelope of its measurements: at a budget it is at least what the window lost at any larger
        measured budget. A larger budget keeps more of the context, so a loss rising with the budget is noise
        or an accident of which tokens a compaction happened to keep; read conservatively, it must not make a
        smaller budget look better (H2O without sinks: +89% at 0.25 and +99% at 0.5, the fourth window rising
        from 0.24 to 0.67 NLL; the envelope reads 0.67 at 0.25 there). Where the measurements already fall
        with the budget it changes nothing. The envelope runs over the measured budgets only, not over the 0
        at 1.0: a window measured slightly below zero near 1.0 (noise) is not raised to zero at every smaller
        budget, and on the last segment all windows scale alike, so the mean, the worst window and their
        bounds still fall along it."""
        rows = [(k["eviction.budget_fraction"], d) for k, d in self._table("evict")
                if k["eviction.policy"] == policy and k["eviction.sink_tokens"] == sinks]
        if not rows:
            return None
        rows.sort()
        xs, ys = [f for f, _ in rows], [list(d) for _, d in rows]
        if monotone:
            _raise_to_larger_budgets(ys)
        if xs[-1] < 1.0:  # nothing is evicted at a budget of the whole context
            xs.append(1.0)
            ys.append([0.0] * len(self._full))
        return xs, ys

    def _evict_at(self, policy: str, sinks: int, fraction: float, monotone: bool = True) -> list[float] | None:
        curve = self._evict_curve(policy, sinks, monotone)
        return None if curve is None else _interp(fraction, *curve)

    def _variant_fractions(self, policy: str) -> list[float]:
        """The budgets ``policy``'s variants were measured at, ascending."""
        return sorted({k["eviction.budget_fraction"] for k, _ in self._table("evict-variant")
                       if k["eviction.policy"] == policy})

    def _variant_delta(self, policy: str, knob: str, value: Any, ref: float) -> list[float] | None:
        """Per-window loss of ``policy`` with ``knob`` at ``value`` minus its loss with the default knobs, both
        at the measured reference budget ``ref`` (None where that variant was not measured there)."""
        base = self._evict_at(policy, REFERENCE_SINKS, ref)
        for knobs, deltas in self._table("evict-variant"):
            if (knobs["eviction.policy"] == policy and knobs.get(knob) == value
                    and knobs["eviction.budget_fraction"] == ref):
                return None if base is None else [v - b for v, b in zip(deltas, base)]
        return None

    def _across_references(self, policy: str, fraction: float, effect) -> list[float]:
        """A variant's per-window effect (``effect(reference budget)``, an additive difference in NLL) at the
        config's budget ``fraction``: linear between the measured references; above the highest, falling
        linearly to nothing at a budget of the whole context; below the lowest, an effect that adds loss
        (its mean over the windows above zero) grows with the policy's own loss (large there, and the
        variants' effects grow with it: the mean grows, each window keeping its measured difference to
        it), while one that removes loss is held at its measured size: growing
        an improvement is an extrapolation in the optimistic direction that no measurement supports (SnapKV's
        own loss at 0.1 is 7.8x its loss at 0.25; a -0.026 NLL measured on one window at 0.25 would read
        -0.2 at 0.1). Differences, not ratios: at a budget where the policy itself loses next to nothing
        (SnapKV at 0.5: +0.05%, within its noise), a ratio to that loss is noise over noise."""
        refs = self._variant_fractions(policy)
        if not refs:
            return [0.0] * len(self._full)
        if fraction <= refs[0]:
            at_ref = effect(refs[0])
            mean = sum(at_ref) / len(at_ref)
            if mean <= 0:
                return at_ref
            base_ref = self._evict_at(policy, REFERENCE_SINKS, refs[0])
            base_here = self._evict_at(policy, REFERENCE_SINKS, fraction)
            grow = sum(base_here) / sum(base_ref) if base_ref and base_here and sum(base_ref) > 0 else 1.0
            # (what grows is the mean effect; its spread between windows, mostly the noise of a window's
            # decoded tokens, is kept as measured rather than amplified with it)
            return [d + (max(grow, 1.0) - 1.0) * mean for d in at_ref]
        if fraction >= refs[-1]:
            fade = (1.0 - fraction) / (1.0 - refs[-1]) if refs[-1] < 1.0 else 0.0
            return [fade * d for d in effect(refs[-1])]
        return _interp(fraction, refs, [effect(r) for r in refs])

    def _evict(self, config: KVConfig, context_tokens: int | None = None) -> list[float] | None:
        ev = config.eviction
        if ev.policy == "none":
            return [0.0] * len(self._full)
        measured_sinks = sorted({k["eviction.sink_tokens"] for k, _ in self._table("evict")
                                 if k["eviction.policy"] == ev.policy})
        if not measured_sinks or ev.sink_tokens < measured_sinks[0]:
            return None
        base_sinks = max(s for s in measured_sinks if s <= ev.sink_tokens)
        curve = self._evict_envelope(ev.policy, base_sinks, ev.recent_window, ev.layer_schedule)
        return None if curve is None else _interp(self.fraction(config, context_tokens), *curve)

    def _evict_envelope(self, policy: str, sinks: int, recent: int,
                        schedule: str) -> tuple[list[float], list[list[float]]] | None:
        """The composed per-window eviction loss (`_evict_composed`) as a function of the budget, made
        non-increasing in it: sampled at every measured budget and every hundredth between the smallest and
        the largest measured one (of the policy's curve and its variants), each window's value raised to the
        largest at any larger sampled budget (the upper monotone envelope), linear between the samples; above
        the largest measured budget it falls linearly to 0 at 1.0, as the policy's own curve does (all windows
        alike, so the mean, the worst window and their bounds fall along it even where a window sits below
        zero by noise, which the envelope is not to lift to zero at every budget). The composition adds
        differences measured at other budgets to the policy's curve, and nothing in such a sum keeps a larger
        budget from predicting more loss (SnapKV with 16 sinks: 0.11 predicted 4.6 points above 0.10); the
        envelope keeps the prediction conservative wherever the sum rises, and equals it wherever it already
        falls. Cached per knob set (about a hundred compositions, once)."""
        key = (policy, sinks, recent, schedule)
        if key not in self._envelopes:
            base = self._evict_curve(policy, sinks)
            if base is None:
                self._envelopes[key] = None
            else:
                lo = base[0][0]  # (below the policy's smallest measured budget: no prediction)
                knots = {x for x in base[0] + self._variant_fractions(policy) if lo <= x < 1.0} or {lo}
                hi = max(knots)
                samples = {lo + i / 100 for i in range(int(math.floor((hi - lo) * 100 + 1e-9)) + 1)}
                xs = sorted({round(x, 9) for x in knots | samples if x <= hi})
                ys = [self._evict_composed(policy, sinks, recent, schedule, x) for x in xs]
                _raise_to_larger_budgets(ys)
                if xs[-1] < 1.0:  # nothing is evicted at a budget of the whole context
                    xs, ys = xs + [1.0], ys + [[0.0] * len(self._full)]
                self._envelopes[key] = (xs, ys)
        return self._envelopes[key]

    def _noise_floor(self, policy: str) -> list[float]:
        """Per window, the lowest loss any eviction measurement of ``policy`` gave on it, or 0 if none was
        negative: how far below the full cache the measurements' noise reaches there. A composed prediction
        is held at or above it (`_evict_composed`)."""
        floor = [0.0] * len(self._full)
        for kind in ("evict", "evict-variant"):
            for knobs, deltas in self._table(kind):
                if knobs["eviction.policy"] == policy:
                    floor = [min(f, d) for f, d in zip(floor, deltas)]
        return floor

    def _evict_composed(self, policy: str, sinks: int, recent: int, schedule: str,
                        fraction: float) -> list[float]:
        """Per-window eviction loss at ``fraction`` before the budget envelope: the policy's curve plus what
        the config's recent window and layer schedule add to it, each window held at or above the
        measurements' noise floor (`_noise_floor`). Evicting tokens cannot make the model better than the
        full cache except by noise, yet differences measured at other budgets and windows can sum to far
        less: SnapKV at 0.1 with a 16-token window summed to -0.97 NLL on two of four windows (-62%
        perplexity), and the mean, clamped at zero, then read as lossless. Clamped per window, before the
        mean and the bounds are taken, so one window's manufactured gain cannot hide another's loss."""
        deltas = self._evict_at(policy, sinks, fraction)
        if recent != DEFAULT_RECENT:
            effect = self._across_references(
                policy, fraction, lambda ref: self._recent_effect(policy, recent, fraction, ref))
            deltas = [d + e for d, e in zip(deltas, effect)]
        if schedule == "pyramid":
            zero = [0.0] * len(self._full)
            effect = self._across_references(
                policy, fraction,
                lambda ref: self._variant_delta(policy, "eviction.layer_schedule", "pyramid", ref) or zero)
            deltas = [d + e for d, e in zip(deltas, effect)]
        return [max(d, f) for d, f in zip(deltas, self._noise_floor(policy))]

    def _recent_effect(self, policy: str, recent: int, fraction: float, ref: float) -> list[float]:
        """What a recent window adds to the loss against the default one at a budget ``fraction``, from the
        variants measured at the reference budget ``ref``. The policy splits its budget between the recent
        window and the tokens it scores, so a window's effect is read at the same share of the budget as in
        the reference measurement: both windows are scaled by ``ref`` / ``fraction``, and their effects
        subtract (the base curve was measured with the default window at every budget).

        Never read larger than it is (a budget below the reference): that reads the default window on the
        measured large-window branch (64 at 0.1 as 160 at 0.25, most of the way to 256, which takes the whole
        budget there and lost +13% against +1.8% for SnapKV) and credits every smaller window with avoiding
        that loss; grown with the policy's loss below the references it put two of SnapKV's windows at -0.97
        NLL at 0.1 with a 16-token window, read as lossless. No measurement supports a gain that size: at 0.1
        on two held-out windows SnapKV lost +34% with a 17-token window, +31% with 32 and +38% with the
        default 64, and at both reference budgets 16 tokens lost more than 64. Read at its own size there,
        the window's effect is the measured one (grown below the references, `_across_references`). A
        budget above the reference shrinks both windows (a window takes a smaller share of a larger budget),
        as checked on the joint configs."""
        k = min(1.0, ref / max(fraction, 1e-9))
        mine, default = self._recent_at(policy, recent * k, ref), self._recent_at(policy, DEFAULT_RECENT * k, ref)
        return [a - b for a, b in zip(mine, default)]

    def _recent_at(self, policy: str, recent: float, ref: float) -> list[float]:
        """A recent window's per-window effect at the reference budget ``ref``: interpolated in log2(window)
        between the measured 16 / 64 (none) / 256 variants, held outside."""
        points = [(math.log2(DEFAULT_RECENT), [0.0] * len(self._full))]
        for r in (16, 256):
            delta = self._variant_delta(policy, "eviction.recent_window", r, ref)
            if delta is not None:
                points.append((math.log2(r), delta))
        points.sort()
        x = math.log2(max(1.0, recent))
        return _interp(min(max(x, points[0][0]), points[-1][0]), [p for p, _ in points], [d for _, d in points])

    # ---- needle -----------------------------------------------------------------------------------------
    def needle_measured(self, config: KVConfig) -> tuple[int, int, float] | None:
        """The passkey trials of exactly ``config``, if it was measured: (found, trials, share of the full
        cache's accuracy kept); None otherwise (`predict` then reads a measured config near it)."""
        for entry in self.data.get("needle", {}).values():
            if entry["kind"] != "needle-full" and KVConfig().with_knobs(entry["knobs"]) == config:
                share = self._needle_share(entry["knobs"])
                found = entry["found"]
                return sum(found), len(found), (0.0 if share is None else share)
        return None

    def _needle_share(self, key: dict) -> float | None:
        acc = self._needle.get(knob_key(key))
        if acc is None or not self._needle_full:
            return None
        return min(1.0, acc / self._needle_full)

    def _needle_bits(self, config: KVConfig) -> float:
        bw = config.bitwidth
        pairs = bw.layer_bits or ((bw.key_bits, bw.value_bits),)
        lowest = min(min(p) for p in pairs)
        if lowest == FULL_BITS:
            return 1.0
        measured = sorted({e["knobs"]["bitwidth.key_bits"] for e in self.data.get("needle", {}).values()
                           if e["kind"] == "needle-bits"})
        at_or_below = [b for b in measured if b <= lowest]
        if not at_or_below:
            return 0.0
        share = self._needle_share({"bitwidth.key_bits": at_or_below[-1], "bitwidth.value_bits": at_or_below[-1]})
        return 0.0 if share is None else share

    def _needle_evict(self, config: KVConfig, context_tokens: int | None) -> float:
        ev = config.eviction
        if ev.policy == "none":
            return 1.0
        fraction = self.fraction(config, context_tokens)
        if fraction >= 1.0:
            return 1.0
        measured = sorted(e["knobs"]["eviction.budget_fraction"] for e in self.data.get("needle", {}).values()
                          if e["kind"] == "needle-evict" and e["knobs"]["eviction.policy"] == ev.policy)
        at_or_below = [f for f in measured if f <= fraction + 1e-12]
        if not at_or_below:
            return 0.0
        share = self._needle_share({"eviction.policy": ev.policy, "eviction.budget_fraction": at_or_below[-1]})
        return 0.0 if share is None else share

    # ---- the prediction --------------------------------------------------------------------------------
    def window_deltas(self, config: KVConfig, context_tokens: int | None = None) -> list[float] | None:
        """Predicted per-window NLL increase of ``config`` (None where the grid cannot say). Quantized KV at a
        block size the profile did not measure is outside the grid: keys are quantized per channel over a block's
        tokens, so larger blocks lose more (a tester measured 2-bit keys +26% at blocks of 16, +74% at 64, both
        predicted +25%). A combination of quantization with an eviction read on every position never reads below
        either part, window by window: an eviction whose windows read below zero by noise had lowered the loss and
        the bound of the quantization it was added to (`predict` floors every combination's bounds so)."""
        if quantized_changes(config) and config.prefix_reuse.block_size != self.block_size:
            return None
        bits, evict = self._bits(config), self._evict(config, context_tokens)
        if bits is None or evict is None:
            return None
        if config.eviction.policy in ("none", "snapkv") or not quantized_changes(config):
            # (one family; or SnapKV, whose 64 decoded tokens a window are noise both ways: lifting its windows
            # over-predicted its held-out joint configs by 20-50%)
            return [a + b for a, b in zip(bits, evict)]
        return [max(a + b, a, b) for a, b in zip(bits, evict)]

    @property
    def block_size(self) -> int:
        """The KV block size the profile measured its configs at (its protocol's, else the runtime's default)."""
        return int((self.data.get("protocol") or {}).get("block_size", KVConfig().prefix_reuse.block_size))



    def predict(self, config: KVConfig, model: str | None = None, context_tokens: int | None = None) -> QualityLoss:
        """The predicted loss of ``config`` (a proxy for a ``model`` other than the profile's; token budgets
        read against ``context_tokens``, see `fraction`)."""
        if not structural_changes(config):
            return NO_LOSS
        deltas = self.window_deltas(config, context_tokens)
        if deltas is None:
            return UNKNOWN
        n = len(deltas)
        mean_delta = sum(deltas) / n
        worst = max(math.exp(d) - 1 for d in deltas)
        needle = self._needle_bits(config) * self._needle_evict(config, context_tokens)
        basis = "measured" if model in (None, self.model) else f"proxy: {self.model}"
        loss = QualityLoss(max(0.0, math.exp(mean_delta) - 1), max(0.0, worst), needle, basis=basis,
                           ppl_mean_bound=max(0.0, math.exp(mean_delta + _upper_margin(deltas)) - 1),
                           ppl_worst_bound=max(0.0, math.exp(mean_delta + _upper_margin(deltas, True)) - 1))
        if config.eviction.policy == "none" or not quantized_changes(config):
            return loss
        # (the windows of a combination can spread less than its quantization's alone, and its bounds read lower
        # by that: a floor that rejected int4 admitted int4 with a near-lossless eviction added)
        parts = [self.predict(dataclasses.replace(config, bitwidth=type(config.bitwidth)()), model, context_tokens)]
        if loss_metric(config.eviction.policy) == loss_metric(None):  # (the bits alone, read as this policy reads)
            parts.append(self.predict(dataclasses.replace(config, eviction=type(config.eviction)()), model,
                                      context_tokens))
        return dataclasses.replace(loss, ppl_mean_bound=max([loss.ppl_mean_bound] + [q.guarded_mean for q in parts]),
                                   ppl_worst_bound=max([loss.ppl_worst_bound] + [q.guarded_worst for q in parts]))

    def perplexity_measured(self, config: KVConfig) -> bool:
        """Whether ``config``'s perplexity was measured as it is (a grid point: there `predict` gives the
        measurement), rather than predicted from other measurements."""
        return any(e["kind"] != "full" and KVConfig().with_knobs(e["knobs"]) == config
                   for e in self.data["perplexity"].values())

    def baseline(self) -> dict:
        """The full-precision, no-eviction reference every loss is measured against: its perplexity over
        the profile windows' positions and over their decoded continuations (the tokens SnapKV's losses are
        read on), and its passkeys found / trials."""
        full = self.data["perplexity"][knob_key({})]
        needle = self.data.get("needle", {}).get(knob_key({}))
        continuation = full.get(CONTINUATION)
        return {"ppl_all_positions": math.exp(statistics.fmean(full[ALL_POSITIONS])),
                "ppl_continuation": math.exp(statistics.fmean(continuation)) if continuation else None,
                "needle_found": None if needle is None else sum(needle["found"]),
                "needle_trials": None if needle is None else len(needle["found"])}

    def combination_checks(self) -> list[dict]:
        """Each measured joint config: predicted and measured mean-window loss, and whether the prediction
        is within the goal (`GOAL_RULE`)."""
        out = []
        for knobs, deltas in self._table("joint"):
            config = KVConfig().with_knobs(knobs)
            predicted = self.predict(config).ppl_mean
            measured = math.exp(sum(deltas) / len(deltas)) - 1
            error = abs(predicted - measured)
            out.append({"knobs": knobs, "predicted": predicted, "measured": measured, "error_pp": 100 * error,
                        "within_goal": error <= max(GOAL_RELATIVE * abs(measured), GOAL_ABSOLUTE)})
        return out
