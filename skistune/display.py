"""Rich tables of the figures commands print (one layout for measured and simulated metrics)."""
from __future__ import annotations

from pathlib import Path

import math
import re

from rich import table as rich_table
from rich.progress import ProgressColumn
from rich.text import Text

from skistune.runtime.metrics import Metrics


class Table(rich_table.Table):
    """Every table the commands print: a cell too wide for its column wraps onto more lines (rich's default cut
    it with "..." and lost the figure: a tester's 40-column terminal showed latencies as "19..." and "1,...")."""

    def add_column(self, *args, overflow: str = "fold", **kwargs) -> None:
        super().add_column(*args, overflow=overflow, **kwargs)


LATENCY_COLUMNS = ("p50", "p90", "p99", "max", "mean")
REJECTION_REASONS_SHOWN = 3  # the most common reasons a table lists; --json has every request's
SECONDS_FROM_S = 100.0  # latencies this long or longer print in seconds: in ms they overflow an 80-column table


def metrics_table(m: Metrics, title: str = "Metrics") -> Table:
    """Latency percentiles, in ms, or in s when some figure reaches `SECONDS_FROM_S` (an overloaded or
    long-prompt workload queues for hours)."""
    values = {name: [m.latency(name).at(c) for c in LATENCY_COLUMNS] for name in ("ttft", "tbt", "e2e", "tpot")}
    in_s = any(x >= SECONDS_FROM_S for row in values.values() for x in row if x == x)
    unit, scale, digits = ("s", 1.0, 3) if in_s else ("ms", 1e3, 1)  # (to the ms: a TBT of 0.03 s said little)
    lat = Table(title=title, title_justify="left")
    lat.add_column(f"latency ({unit})")
    for col in LATENCY_COLUMNS:
        lat.add_column(col, justify="right")
    for name, row in values.items():
        lat.add_row(name.upper(), *("-" if x != x else f"{x * scale:,.{digits}f}" for x in row))
    return lat


def summary_table(m: Metrics, energy: dict | None = None, prefetch: str | None = None,
                  quality: dict | None = None) -> Table:
    """Counts, duration, throughput, memory and (``energy``: an `evaluate.energy_figure`) J/token; why
    requests were rejected, grouped by reason. ``prefetch``: the config's prefetch (`prefetch_mode`), which
    says why a tier's prefetch hit rate is n/a (None: not known)."""
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [
        ("requests (finished / rejected)", f"{m.num_finished} / {m.num_rejected} of {m.num_requests}"),
        *(("why rejected" if i == 0 else "", line) for i, line in enumerate(rejection_lines(m))),
        ("duration", f"{m.duration_s:,.2f} s"),
        # (req/s to 3 significant digits: a long trace's 0.01548 req/s printed to 2 decimals read 0.02)
        ("throughput", f"{m.throughput_tok_per_s:,.1f} tok/s, {significant(m.throughput_req_per_s)} req/s"),
        ("KV peak / capacity", f"{m.kv_peak_bytes / 2**20:,.1f} / {m.kv_capacity_bytes / 2**20:,.1f} MiB"),
        ("preemptions", f"{m.preemptions}"),
        ("prefix-hit tokens", prefix_hits(m)),
    ]
    if energy is not None:
        rows.append(("energy", f"{format_figure(energy['j_per_token'], 3)} J/token ({energy['basis']})"))
    if quality is not None:  # (`evaluate.quality_figure`: a lossy config's predicted loss)
        rows.append(("quality loss (predicted)", quality_text(quality)))
    if m.evicted_tokens:
        rows.append(("evicted KV tokens", f"{m.evicted_tokens:,}"))
    if m.tiers is not None:
        rows += tier_rows(m.tiers, prefetch)
    for label, value in rows:
        t.add_row(label, value)
    for note in m.notes:
        t.add_row("note", note)
    if energy is not None and energy.get("modeled_note"):
        t.add_row("note", energy["modeled_note"])
    return t


def quality_text(q: dict) -> str:
    """``Δppl mean +0.46% (95% bound +0.84%), worst window +1.20%; <basis>``; outside the profile's grid: said."""
    if q["ppl_mean"] is None:
        return f"outside the quality profile's grid: unknown, and no floor admits it ({q['basis']})"
    worst = f"{q['ppl_worst']:+.2%}" if q["ppl_worst"] is not None else "unknown"
    source = Path(q["profile"]).name if q.get("profile") else "the quality profile"
    proxy = f", {q['basis']}" if str(q["basis"]).startswith("proxy") else ""
    return (f"Δppl mean {q['ppl_mean']:+.2%} (95% bound {q['ppl_mean_bound']:+.2%}), worst window {worst} "
            f"({source}{proxy})")


def prefix_hits(m: Metrics) -> str:
    """Prefix-hit tokens against the prompt tokens, those at re-admissions after a preemption apart (a
    preempted request finds its own blocks still cached, on a trace that shares no prefix too)."""
    text = f"{m.prefix_hit_tokens:,} of {m.prompt_tokens:,} prompt tokens"
    if m.readmission_hit_tokens:
        text += f" ({m.readmission_hit_tokens:,} at re-admissions after preemption)"
    return text


def format_figure(x: float, digits: int = 1) -> str:
    """A figure with thousands separators, or ``-`` where there is none (NaN: no request finished, or no
    token gap with one output token; infinite: no token generated to divide by)."""
    return "-" if x != x or x in (float("inf"), float("-inf")) else f"{x:,.{digits}f}"


def significant(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits in plain notation (0.0155, 1.55, 15.5, 155; 1,548 as 1,550,
    not 1.55e+03), or ``-`` where there is no figure (see `format_figure`)."""
    if x != x or x in (float("inf"), float("-inf")):
        return "-"
    rounded = float(f"{x:.{digits}g}")  # (rounded first: 0.09996 is 0.100, three digits, not 0.1000)
    if rounded == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:,.{decimals}f}"


def prefetch_mode(config) -> str:
    """What a config's prefetch does, for `tier_rows`: off, blocks (the hit rate counts those) or layers
    (a step's own copies overlapped layer by layer: no block is prefetched ahead, so there is no hit rate)."""
    return config.prefetch.unit if config.prefetch.enabled else "off"


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def rejection_lines(m: Metrics, limit: int = REJECTION_REASONS_SHOWN) -> list[str]:
    """Why requests were rejected, grouped by reason (reasons that differ only in their numbers are one,
    each number shown as the range it spans: ``needs 18-45 KV blocks, the cache holds 1: 6 requests``),
    most common first: at most ``limit`` lines, then how many requests other reasons rejected."""
    groups: dict[str, list[list[float]]] = {}  # reason with its numbers blanked -> the numbers of each
    for reason in m.rejections.values():
        groups.setdefault(_NUMBER.sub("#", reason), []).append([float(x) for x in _NUMBER.findall(reason)])
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))  # (stable: ties in order of first rejection)
    lines = [f"{_with_ranges(template, numbers)}: {_requests(len(numbers))}" for template, numbers in ranked[:limit]]
    rest = ranked[limit:]
    if rest:
        lines.append(f"{len(rest)} other reason{'s' if len(rest) != 1 else ''}: "
                     f"{_requests(sum(len(n) for _, n in rest))} (--json lists each request's)")
    return lines


def _with_ranges(template: str, numbers: list[list[float]]) -> str:
    """``template`` with each ``#`` replaced by its number, or by the range of its numbers across requests."""
    parts = template.split("#")
    out = [parts[0]]
    for i, part in enumerate(parts[1:]):
        lo, hi = min(n[i] for n in numbers), max(n[i] for n in numbers)
        out.append((f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}") + part)
    return "".join(out)


def _requests(n: int) -> str:
    return f"{n} request{'s' if n != 1 else ''}"


def tier_rows(tiers, prefetch: str | None = None) -> list[tuple[str, str]]:
    """What the host and disk tiers did: their peaks, the bytes moved each way, swaps (and those that fell
    back to recomputing), disk blocks lost to refused writes or corrupt, transfer time and the prefetch hit
    rate (``prefetch``: see `summary_table`)."""
    mib = (lambda n: f"{n / 2**20:,.1f}")
    rows = [(f"{tier} tier peak / capacity", f"{mib(tiers.peak_bytes[tier])} / {mib(cap)} MiB")
            for tier, cap in tiers.capacity_bytes.items() if cap]
    if tiers.moved_bytes:
        rows.append(("KV moved", ", ".join(f"{link} {mib(n)} MiB" for link, n in tiers.moved_bytes.items())))
    rows.append(("swapped out / in, demoted / promoted", f"{tiers.swapped_out:,} / {tiers.swapped_in:,}, "
                                                          f"{tiers.demotions:,} / {tiers.promotions:,}"))
    if tiers.swap_fallbacks:  # (in the JSON only, before: a swap config that mostly recomputed looked fine)
        rows.append(("swaps recomputed instead (no host room)", f"{tiers.swap_fallbacks:,}"))
    # (a full disk had shown only as a warning on stderr, with every demoted block in KV moved and the peak)
    if tiers.disk_write_errors:
        rows.append(("disk write errors", f"{_blocks(tiers.disk_write_errors)} lost (disk full, over quota or I/O "
                                          "error): recomputed when needed; not in KV moved, in the disk peak"))
    if tiers.corrupt_blocks:
        rows.append(("corrupt disk blocks", f"{_blocks(tiers.corrupt_blocks)} failed the checksum check: recomputed"))
    rows.append(("transfers / stalls, prefetch hits",
                 f"{tiers.transfer_s:.3f} / {tiers.stall_s:.3f} s, {_prefetch_hits(tiers, prefetch)}"))
    return rows


def _blocks(n: int) -> str:
    return f"{n:,} block{'s' if n != 1 else ''}"


def _prefetch_hits(tiers, prefetch: str | None) -> str:
    """The share of promoted blocks that a prefetch brought up, or why there is none. The rate counts blocks
    promoted on demand as misses, so with nothing prefetched (prefetch off, among others) it was 0%, as if
    prefetching had failed."""
    if tiers.prefetched == 0:
        why = {"off": "prefetch off", "layers": "layer-wise prefetch"}.get(prefetch, "nothing prefetched")
        return f"n/a ({why})"
    if tiers.prefetch_hit_rate is None:
        return "n/a (no promoted block used)"
    return f"{tiers.prefetch_hit_rate:.0%}"


def format_duration(seconds: float) -> str:
    """A duration as people say it: ``45 s``, ``12 min``, ``1.6 h``, ``2.3 days``."""
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def clock_time(seconds: float) -> str:
    """``H:MM:SS`` (rich's elapsed-time format, for the ETA beside it)."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class EtaColumn(ProgressColumn):
    """A run's time left, from the task's ``eta_s`` and ``eta_lower_bound`` fields (`evaluate.run_eta_s`):
    ``ETA 0:12:30``, ``ETA >=0:05:00`` where only the time until the last arrival is known, ``ETA ?`` before
    anything is."""

    def render(self, task) -> Text:
        eta_s, lower = task.fields.get("eta_s"), task.fields.get("eta_lower_bound", False)
        if eta_s is None:
            return Text("ETA ?", style="progress.remaining")
        return Text(f"ETA {'>=' if lower else ''}{clock_time(eta_s)}", style="progress.remaining")
