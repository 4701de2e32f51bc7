"""Axis helpers shared by the plots (`skistune report`, `skistune workload show --plot`)."""
from __future__ import annotations

import math
from typing import Callable

LOG_AXIS_SPAN = 20  # values spanning more than this factor are plotted on a log axis


def wants_log(low: float, high: float) -> bool:
    """Whether positive values from ``low`` to ``high`` span enough for a log axis: on a short span a log axis
    only crowds its labels."""
    return 0 < low and high > LOG_AXIS_SPAN * low


def plain_number(value: float) -> str:
    """A tick's value in plain notation, to 3 significant digits without trailing zeros, thousands separated:
    "0.0002", "0.5", "20", "1,000", "1,000,000" (``:g`` wrote "1e+06" and "1e-05")."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    text = f"{value:,.{max(0, 2 - math.floor(math.log10(abs(value))))}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def log_axis(axis, set_scale: Callable[[str], None], low: float, high: float) -> None:
    """A log axis labelled in plain numbers (`plain_number`) at 1, 2 and 5 of each decade: the default labels
    every minor tick of a short span in scientific notation ("2x10^0 3x10^0 ..."), and they overlap; past two
    decades 2 and 5 go unlabelled too ("500" ran into "1000" on a panel from 30 ms to 6 s)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    set_scale("log")
    plain = FuncFormatter(lambda v, _: plain_number(v))
    axis.set_major_formatter(plain)
    axis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    axis.set_minor_formatter(plain if high <= 100 * low else NullFormatter())


# a label's offsets from its point (typographic points), nearest first, each way round: the first that covers no
# other point is used
LABEL_OFFSETS = tuple((sx * d, sy * d) for d in (14, 28, 48) for sy in (1, -1) for sx in (1, -1))


def place_label(ax, text: str, xy: tuple[float, float], avoid_px, taken: list, **style):
    """Annotate the data point ``xy`` with ``text`` joined to it by a leader line, at the first of
    `LABEL_OFFSETS` where the text stays inside the axes and covers none of the points ``avoid_px`` (display
    pixels, [n, 2]) and none of the boxes in ``taken`` (labels placed before; this one's is appended); where
    none is clear, at the first. A label written beside its point without a line had sat over a neighbouring
    dot (the #1 label read as trial 4's, 0.0514 req/s, not the ringed 0.0554's). Returns the annotation."""
    import numpy as np
    from matplotlib.text import Text

    pad = 6 * ax.figure.dpi / 72  # a point's marker radius (the ring's: 12 pt across), in pixels
    bounds, avoid = ax.get_window_extent(), np.asarray(avoid_px, dtype=float).reshape(-1, 2)

    def at(dx: float, dy: float):
        """The annotation at this offset, the line from its nearest corner, and the text's own box."""
        right, up = dx > 0, dy > 0
        note = ax.annotate(text, xy, xytext=(dx, dy), textcoords="offset points", ha="left" if right else "right",
                           va="bottom" if up else "top",
                           arrowprops={"arrowstyle": "-", "color": "0.35", "lw": 0.7, "shrinkA": 0, "shrinkB": 7,
                                       "relpos": (0.0 if right else 1.0, 0.0 if up else 1.0)}, **style)
        note.get_window_extent()  # (lays the text out at its offset: before that, its box sits at 0, 0)
        return note, Text.get_window_extent(note)  # the text alone: the annotation's own box includes its line

    for offset in LABEL_OFFSETS:
        note, box = at(*offset)
        inside = bounds.x0 <= box.x0 and box.x1 <= bounds.x1 and bounds.y0 <= box.y0 and box.y1 <= bounds.y1
        if inside and not box.padded(pad).count_contains(avoid) and not box.count_overlaps(taken):
            break
        note.remove()
    else:  # nowhere clear: the nearest offset all the same
        note, box = at(*LABEL_OFFSETS[0])
    taken.append(box)
    return note
