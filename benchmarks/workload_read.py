"""Trace reading speed: the Azure conv and Mooncake conversation samples, and a generated 1,000,000-row
Azure-format CSV. Prints rows/s for each; ``--json`` ends with one JSON object on the last line.

    python benchmarks/workload_read.py [--rows 1000000] [--repeats 3] [--json]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_args import add_json, description, positive_int, print_json
from skistune.workloads import read_trace

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
SAMPLES = {
    "azure_conv": TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv",
    "mooncake_conversation": TRACES / "mooncake_conversation" / "conversation_trace.head.jsonl",
}


def write_azure_csv(path: Path, rows: int, seed: int = 0) -> None:
    """An Azure-format trace with the conv trace's rate (5.53 req/s) and realistic token counts."""
    rng = np.random.default_rng(seed)
    gaps_ns = rng.exponential(1e9 / 5.53, rows).astype(np.int64)
    stamps = np.datetime64("2023-11-16T18:15:46", "ns") + np.cumsum(gaps_ns).astype("timedelta64[ns]")
    text_stamps = np.char.replace(np.datetime_as_string(stamps, unit="us"), "T", " ")
    context_tokens = rng.integers(2, 14050, rows)
    generated_tokens = rng.integers(7, 1000, rows)
    columns = zip(text_stamps.tolist(), context_tokens.tolist(), generated_tokens.tolist(), strict=True)
    lines = [f"{stamp}0,{context},{generated}" for stamp, context, generated in columns]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(lines) + "\n")


def time_read(path: Path, repeats: int) -> dict:
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        workload = read_trace(path)
        best_s = min(best_s, time.perf_counter() - start)
    return {"rows": len(workload), "seconds": best_s, "rows_per_s": len(workload) / best_s}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--rows", type=positive_int, default=1_000_000, help="rows of the generated Azure-format CSV")
    parser.add_argument("--repeats", type=positive_int, default=3, help="best of this many reads")
    add_json(parser)
    args = parser.parse_args(argv)
    results = {name: time_read(path, args.repeats) for name, path in SAMPLES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "azure_1m.csv"
        write_azure_csv(big, args.rows)
        results[f"azure_generated_{args.rows}"] = time_read(big, args.repeats)
    for name, figures in results.items():
        print(f"{name:32s} {figures['rows']:>9,} rows  {figures['seconds']:7.3f} s  "
              f"{figures['rows_per_s']:>12,.0f} rows/s")
    if args.json:
        print_json({"benchmark": "workload_read", **results})  # (main returns the reads alone)
    return results


if __name__ == "__main__":
    main()
