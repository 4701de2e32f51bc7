"""Service-level objectives: ``METRIC:pXX<=VALUE`` (e.g. ``ttft:p99<=500ms``) or the short form
``pXX=VALUE``, which means TBT (time between tokens) — the convention of Vidur-Search's TBT-P99 SLO.
Metrics: ttft, tbt, e2e, tpot. Percentiles: p50, p90, p95, p99, p99.9, max, mean. Units: s, ms, us, required
(a bare ``p99=200`` is refused: read as seconds it would be a limit a thousand times looser than meant)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from skistune.runtime.metrics import PERCENTILE_NAMES, Metrics

TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_PERCENTILE = "|".join(re.escape(name) for name in PERCENTILE_NAMES)
# a sign and any letters are matched (not only s|ms|us) so that -5ms and 200sec get their own message, not
# the generic "write METRIC:pXX<=VALUE" one
_VALUE = r"([-+]?[0-9.]+(?:e-?[0-9]+)?)([^\W\d_]*)"
_FULL = re.compile(rf"^(ttft|tbt|e2e|tpot):({_PERCENTILE})<={_VALUE}$")
_SHORT = re.compile(rf"^({_PERCENTILE})={_VALUE}$")
_PERCENTILE_WORD = re.compile(r"(?:^|:)(p[0-9.]+)(?:<=|=)")


@dataclass(frozen=True)
class SLO:
    metric: str
    percentile: str
    limit_s: float

    def value_s(self, m: Metrics) -> float:
        return m.latency(self.metric).at(self.percentile)

    def violation(self, m: Metrics) -> float:
        """Relative excess over the limit: <= 0 means met (Optuna's constraint convention). A run with
        no finished request has no latency to check and counts as violated."""
        v = self.value_s(m)
        return 1.0 if v != v else v / self.limit_s - 1.0

    def met(self, m: Metrics) -> bool:
        return self.violation(m) <= 0

    def breaks_above(self) -> tuple[str, str, float]:
        """(metric, percentile, the value of it above which this breaks): what `simulator.CertainMiss` watches."""
        return self.metric, self.percentile, self.limit_s

    def __str__(self) -> str:
        return f"{self.metric}:{self.percentile}<={self.limit_s * 1e3:g}ms"


def parse_slo(text: str) -> SLO:
    t = text.strip().lower().replace(" ", "")
    full, short = _FULL.match(t), _SHORT.match(t)
    if full:
        metric, pct, value, unit = full.groups()
    elif short:
        metric, (pct, value, unit) = "tbt", short.groups()
    else:
        word = _PERCENTILE_WORD.search(t)
        if word and word.group(1) not in PERCENTILE_NAMES:
            raise ValueError(f"SLO {text!r}: percentile {word.group(1)} is not one of "
                             f"{', '.join(PERCENTILE_NAMES)}")
        raise ValueError(f"SLO {text!r}: write METRIC:pXX<=VALUE (e.g. ttft:p99<=500ms) or pXX=VALUE for TBT "
                         "(e.g. p99=200ms); metrics ttft, tbt, e2e, tpot")
    if unit and unit not in TIME_UNITS:
        raise ValueError(f"SLO {text!r}: unknown unit {unit!r}: write the limit in s, ms or us (e.g. p99=200ms)")
    try:
        limit_s = float(value) * TIME_UNITS[unit or "s"]
    except ValueError:
        raise ValueError(f"SLO {text!r}: {value!r} is not a number") from None
    # (before the unit: p99=-5 should hear it must be positive, not "write -5ms")
    if not (limit_s > 0 and math.isfinite(limit_s)):  # 1e999ms parses as inf: a limit nothing can break
        raise ValueError(f"SLO {text!r}: the limit must be a positive, finite time")
    if not unit:
        raise ValueError(f"SLO {text!r}: the limit needs a unit: write {value}ms or {limit_s * 1e-3:g}s "
                         "(units: s, ms, us)")
    return SLO(metric, pct, limit_s)


def as_slos(value, *, guards: bool = False) -> list:
    """One SLO or its text, or an iterable of them (None: none), as `SLO` objects, the texts parsed by
    `parse_slo`. With ``guards``, other objects with a ``met(metrics)`` method pass too (the optimizer's
    queueing guard, in `simulator.capacity`). Anything else is a ``TypeError``."""
    items = [] if value is None else [value] if isinstance(value, (str, SLO)) else value
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"slos: expected SLO strings such as 'p99=200ms' (or SLO objects), got "
                        f"{type(value).__name__}") from None
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(parse_slo(item))
        elif isinstance(item, SLO) or (guards and callable(getattr(item, "met", None))):
            out.append(item)
        else:
            raise TypeError(f"slos: {item!r} is not an SLO: write 'p99=200ms' (TBT p99 <= 200 ms) or "
                            "'ttft:p90<=1s', or pass skistune.slo.parse_slo(...)")
    return out
