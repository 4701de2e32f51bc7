"""Perplexity of SmolLM2-135M through the runtime's own KV path, per KV config: quantized KV and eviction.

Text: the module docstrings of a fixed list of Python standard-library modules (`MODULES`, those with a
docstring, in that order), joined by blank lines, tokenized, and cut into consecutive windows of
``--window-tokens`` (1,500) tokens; the first ``--windows`` are scored. Docstrings change between Python
versions, so the version is printed with the figures.

Each window is served by the real engine (scheduler, eviction budget, block accounting, model runner,
paged KV store at the config's bits) and teacher-forced: its first ``window - continuation`` tokens are the
prompt, computed by chunked prefill in chunks of ``--chunk`` (64) tokens; the last ``--continuation``
(128) are then fed one per decode step, as if generated (the executor "samples" the text's next token).
Every computed position's logits are kept (`ModelRunner.keep_logits`), so each position's next token is
scored: ``ppl`` over the whole window, ``last`` over the last ``continuation`` tokens.

Eviction happens while the text is consumed: a sequence is compacted to its budget after every step that
takes it a block past it, prefill chunks included, so later chunks attend to what the policy kept.
SnapKV is the exception by design: it keeps the whole prompt until the prompt's last token is computed
(its observation window is the prompt's end), so over the prompt its perplexity equals full precision;
its eviction shows only in ``last``, the tokens after the compressed prompt. Budgets are fixed token
counts, the given fraction of the window (25%: 375 tokens), with the config's defaults otherwise
(sink_tokens 4, recent_window 64; keys and values at the same bits, group 32, no full-precision window
but in the rows that say "+ 128 fp").

    python benchmarks/quality_kv.py [--windows 8] [--window-tokens 1500] [--chunk 64] [--continuation 128]
                                    [--only full,int8] [--json]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from bench_args import add_json, description, fail, name_list, positive_int, print_json

import torch

from skistune.config import KVConfig
from skistune.quality.corpus import stdlib_text
from skistune.quality.scoring import window_nll
from skistune.runtime.llm import Runtime

KV_POOL_BYTES = 128 << 20  # a 1,500-token window of SmolLM2 in fp32 is 69 MB of KV


def configs(window_tokens: int) -> dict[str, dict]:
    """Name -> knobs, in table order: full precision, quantized KV, then each policy at each budget."""
    out: dict[str, dict] = {"full": {}}
    for bits in (8, 4, 2):
        out[f"int{bits}"] = {"bitwidth.key_bits": bits, "bitwidth.value_bits": bits}
    for bits in (4, 2):  # KIVI's setting: the newest 128 tokens stay at full precision
        out[f"int{bits} + 128 fp"] = {**out[f"int{bits}"], "bitwidth.full_precision_window": 128}
    for policy in ("streaming", "h2o", "tova", "snapkv"):
        for pct in (25, 50):
            budget = {"eviction.policy": policy, "eviction.budget_tokens": window_tokens * pct // 100}
            out[f"{policy}-{pct}%"] = budget
            if policy == "streaming":
                out[f"{policy}-{pct}% no sinks"] = {**budget, "eviction.sink_tokens": 0}
    return out


def measure(base: Runtime, knobs: dict, windows: list[list[int]], continuation: int, chunk: int) -> list[torch.Tensor]:
    config = KVConfig().with_knobs({"batching.chunk_size": chunk, "batching.max_num_batched_tokens": chunk,
                                    "batching.max_num_seqs": 1, "offload.device_kv_bytes": KV_POOL_BYTES, **knobs})
    rt = base.with_config(config)
    return [window_nll(rt, w, continuation) for w in windows]


def summarize(nlls: list[torch.Tensor], full: list[torch.Tensor], continuation: int) -> dict:
    """Perplexities over all windows' tokens and their change against full precision (mean, worst window)."""
    def ppl(xs):
        return math.exp(torch.cat(xs).mean().item())

    last = [x[-continuation:] for x in nlls]
    per_window = [100 * (math.exp(x.mean().item() - f.mean().item()) - 1) for x, f in zip(nlls, full)]
    return {"ppl": ppl(nlls), "delta_pct": 100 * (ppl(nlls) / ppl(full) - 1), "worst_window_delta_pct": max(per_window),
            "ppl_last": ppl(last), "delta_last_pct": 100 * (ppl(last) / ppl([f[-continuation:] for f in full]) - 1)}


def print_table(results: dict[str, dict], continuation: int) -> None:
    print(f"| config | ppl | Δ | worst window Δ | ppl last {continuation} | Δ last {continuation} |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['ppl']:.3f} | {r['delta_pct']:+.2f}% | {r['worst_window_delta_pct']:+.2f}% | "
              f"{r['ppl_last']:.3f} | {r['delta_last_pct']:+.2f}% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    names = list(configs(1500))  # (the budgets depend on the window, the names do not)
    ap.add_argument("--windows", type=positive_int, default=8)
    ap.add_argument("--window-tokens", type=positive_int, default=1500)
    ap.add_argument("--chunk", type=positive_int, default=64, help="prefill chunk (tokens per step)")
    ap.add_argument("--continuation", type=positive_int, default=128,
                    help="last tokens of a window fed as decode steps")
    ap.add_argument("--only", type=name_list(names), default=[],
                    help="comma-separated config names (full is always measured): "
                    + ", ".join(names).replace("%", "%%"))  # (argparse formats help with %)
    add_json(ap)
    args = ap.parse_args()
    if args.continuation >= args.window_tokens:
        ap.error(f"--continuation {args.continuation} leaves no prompt in windows of {args.window_tokens} tokens")
    torch.manual_seed(0)
    base = Runtime.from_preset("smollm2-135m")
    text, used = stdlib_text()
    ids = base.tokenizer.encode(text)
    n = args.window_tokens
    windows = [ids[i * n:(i + 1) * n] for i in range(min(args.windows, len(ids) // n))]
    if not windows:
        fail(f"--window-tokens {n}: longer than the text ({len(ids)} tokens)")
    wanted = {"full", *args.only}
    results, full = {}, None
    for name, knobs in configs(n).items():
        if args.only and name not in wanted:
            continue
        t0 = time.perf_counter()
        nlls = measure(base, knobs, windows, args.continuation, args.chunk)
        full = full or nlls
        results[name] = {"knobs": knobs, **summarize(nlls, full, args.continuation)}
        print(f"{name}: {results[name]['ppl']:.3f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(f"SmolLM2-135M, {len(windows)} windows of {n} tokens ({len(ids)} tokens of {len(used)} module docstrings, "
          f"Python {sys.version.split()[0]}), prefill chunks of {args.chunk}, last {args.continuation} decoded")
    print_table(results, args.continuation)
    if args.json:
        print_json({"benchmark": "quality_kv", "python": sys.version.split()[0], "modules": used, "tokens": len(ids),
                    "windows": len(windows),
                    "window_tokens": n, "chunk": args.chunk, "continuation": args.continuation,
                    "configs": results})


if __name__ == "__main__":
    main()
