"""Rich tables of the figures commands print (one layout for measured and simulated metrics)."""
from __future__ import annotations

from rich.table import Table

from skistune.runtime.metrics import Metrics


LATENCY_COLUMNS = ("p50", "p90", "p99", "max", "mean")
SECONDS_FROM_S = 100.0  # latencies this long or longer print in seconds: in ms they overflow an 80-column table


def metrics_table(m: Metrics, title: str = "Metrics") -> Table:
    """Latency percentiles, in ms, or in s when some figure reaches `SECONDS_FROM_S` (an overloaded or
    long-prompt workload queues for hours)."""
    values = {name: [m.latency(name).at(c) for c in LATENCY_COLUMNS] for name in ("ttft", "tbt", "e2e", "tpot")}
    in_s = any(x >= SECONDS_FROM_S for row in values.values() for x in row if x == x)
    unit, scale, digits = ("s", 1.0, 2) if in_s else ("ms", 1e3, 1)
    lat = Table(title=title, title_justify="left")
    lat.add_column(f"latency ({unit})")
    for col in LATENCY_COLUMNS:
        lat.add_column(col, justify="right")
    for name, row in values.items():
        lat.add_row(name.upper(), *("-" if x != x else f"{x * scale:,.{digits}f}" for x in row))
    return lat


def summary_table(m: Metrics) -> Table:
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [
        ("requests (finished / rejected)", f"{m.num_finished} / {m.num_rejected} of {m.num_requests}"),
        ("duration", f"{m.duration_s:,.2f} s"),
        ("throughput", f"{m.throughput_tok_per_s:,.1f} tok/s, {m.throughput_req_per_s:,.2f} req/s"),
        ("KV peak / capacity", f"{m.kv_peak_bytes / 2**20:,.1f} / {m.kv_capacity_bytes / 2**20:,.1f} MiB"),
        ("preemptions", f"{m.preemptions}"),
        ("prefix-hit tokens", f"{m.prefix_hit_tokens:,} of {m.prompt_tokens:,} prompt tokens"),
    ]
    if m.evicted_tokens:
        rows.append(("evicted KV tokens", f"{m.evicted_tokens:,}"))
    if m.tiers is not None:
        rows += tier_rows(m.tiers)
    for label, value in rows:
        t.add_row(label, value)
    for note in m.notes:
        t.add_row("note", note)
    return t


def tier_rows(tiers) -> list[tuple[str, str]]:
    """What the host and disk tiers did: their peaks, the bytes moved each way, swaps and transfer time."""
    mib = (lambda n: f"{n / 2**20:,.1f}")
    rows = [(f"{tier} tier peak / capacity", f"{mib(tiers.peak_bytes[tier])} / {mib(cap)} MiB")
            for tier, cap in tiers.capacity_bytes.items() if cap]
    if tiers.moved_bytes:
        rows.append(("KV moved", ", ".join(f"{link} {mib(n)} MiB" for link, n in tiers.moved_bytes.items())))
    rows.append(("swapped out / in, demoted / promoted", f"{tiers.swapped_out} / {tiers.swapped_in}, "
                                                          f"{tiers.demotions} / {tiers.promotions}"))
    hit = "-" if tiers.prefetch_hit_rate is None else f"{tiers.prefetch_hit_rate:.0%}"
    rows.append(("transfers / stalls, prefetch hits", f"{tiers.transfer_s:.3f} / {tiers.stall_s:.3f} s, {hit}"))
    return rows
