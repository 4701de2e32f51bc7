"""Axis helpers shared by the plots (`skistune report`, `skistune workload show --plot`)."""
from __future__ import annotations

from typing import Callable

LOG_AXIS_SPAN = 20  # values spanning more than this factor are plotted on a log axis


def wants_log(low: float, high: float) -> bool:
    """Whether positive values from ``low`` to ``high`` span enough for a log axis: on a short span a log axis
    only crowds its labels."""
    return 0 < low and high > LOG_AXIS_SPAN * low


def log_axis(axis, set_scale: Callable[[str], None], low: float, high: float) -> None:
    """A log axis labelled in plain numbers at 1, 2 and 5 of each decade: the default labels every minor tick
    of a short span in scientific notation ("2x10^0 3x10^0 ..."), and they overlap; past two decades 2 and 5
    go unlabelled too ("500" ran into "1000" on a panel from 30 ms to 6 s)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    set_scale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    axis.set_major_formatter(plain)
    axis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    axis.set_minor_formatter(plain if high <= 100 * low else NullFormatter())
