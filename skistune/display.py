"""Rich tables of the figures commands print (one layout for measured and simulated metrics)."""
from __future__ import annotations

from rich.table import Table

from skistune.runtime.metrics import Metrics


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:,.1f}"


def metrics_table(m: Metrics, title: str = "Metrics") -> Table:
    lat = Table(title=title, title_justify="left")
    lat.add_column("latency (ms)")
    for col in ("p50", "p90", "p99", "max", "mean"):
        lat.add_column(col, justify="right")
    for name in ("ttft", "tbt", "e2e", "tpot"):
        p = m.latency(name)
        lat.add_row(name.upper(), *(_ms(p.at(c)) for c in ("p50", "p90", "p99", "max", "mean")))
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
    for label, value in rows:
        t.add_row(label, value)
    for note in m.notes:
        t.add_row("note", note)
    return t
