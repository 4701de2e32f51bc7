"""Greedy generation throughput of the skistune runtime vs Hugging Face transformers, side by side.

Both load the same SmolLM2-135M-Instruct GGUF (dequantised to fp32), get the same prompts (equal token
length, so transformers needs no padding) and generate the same number of tokens greedily, ignoring
EOS. Prints tokens/s of each, their ratio and whether the greedy tokens are identical.

Each batch size is run ``--repeats`` times, the two alternating (ours, theirs, ours, ...), and the median of
each counts: on a shared 2-core machine one stall of torch's threads moves a single run by 10-40%, and
alternating spreads a slow spell over both.

    python benchmarks/runtime_throughput.py [--batch-sizes 1 8 32] [--prompt-tokens 32] [--new-tokens 64]
                                            [--repeats 3] [--json]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

from bench_args import add_json, description, fail, positive_int, print_json

import torch

from skistune.config import KVConfig
from skistune.runtime.llm import Runtime
from skistune.runtime.request import Request
from skistune.runtime.weights import find_smollm2_gguf


WARM_PROMPTS = 2  # the warm-up's batch, before any timed one


def prompt_text() -> str:
    """The text prompts are cut from: the stdlib's English docs."""
    import argparse as a, collections as c, json as j, logging as lg, unittest as u
    return "\n".join(m.__doc__ for m in (a, c, j, lg, u))


def longest_prompt(text_tokens: int, n: int) -> int:
    """The most tokens each of ``n`` prompts can have, cut from a text of ``text_tokens`` (`prompt_token_ids`
    starts them at least a token apart)."""
    return text_tokens - (n - 1)


def prompt_token_ids(tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of exactly `length` tokens, cut at different offsets of the stdlib's English docs."""
    ids = tokenizer.encode(prompt_text())
    stride = max(1, (len(ids) - length) // max(1, n))
    return [ids[i * stride:i * stride + length] for i in range(n)]


def check_lengths(prompt_tokens: int, new_tokens: int, batch_sizes: list[int]) -> None:
    """Before the model loads: prompts longer than the text can give had been cut short, and transformers then
    failed on prompts of unequal length, after the load and the warm-up. Only the tokenizer is read (a
    second)."""
    from skistune.runtime.presets import PRESETS
    from skistune.runtime.tokenizer import Tokenizer

    text_tokens = len(Tokenizer.from_gguf(find_smollm2_gguf()).encode(prompt_text()))
    batch = max(WARM_PROMPTS, *batch_sizes)
    most = longest_prompt(text_tokens, batch)
    if prompt_tokens > most:
        fail(f"--prompt-tokens {prompt_tokens}: the prompt text gives at most {most} tokens per prompt (it has "
             f"{text_tokens}; the prompts of a batch, up to {batch} with the warm-up's {WARM_PROMPTS}, start a token "
             "apart or more)")
    context = PRESETS["smollm2-135m"].max_context
    if prompt_tokens + new_tokens > context:
        fail(f"--prompt-tokens {prompt_tokens} --new-tokens {new_tokens}: more than the model's context of "
             f"{context} tokens")


def run_skistune(rt: Runtime, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    engine = rt.new_engine()
    records = [engine.add_request(Request(f"p{i}", p, new_tokens)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    engine.run_until_done()
    return time.perf_counter() - t0, [r.output_token_ids for r in records]


def run_transformers(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def load_transformers():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    path = find_smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    # EOS ignored as the runtime ignores it: generation runs to max_new_tokens and may emit the EOS token
    # (min_new_tokens would instead forbid it, a different greedy choice wherever EOS is the argmax)
    model.generation_config.eos_token_id = None
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=positive_int, default=32)
    ap.add_argument("--new-tokens", type=positive_int, default=64)
    ap.add_argument("--repeats", type=positive_int, default=3, help="runs of each, alternating; the median counts")
    add_json(ap)
    args = ap.parse_args()
    check_lengths(args.prompt_tokens, args.new_tokens, args.batch_sizes)
    logging.disable(logging.WARNING)

    cfg = KVConfig().with_knobs({"offload.device_kv_bytes": 512 << 20})
    rt = Runtime.from_preset("smollm2-135m", cfg)
    hf = load_transformers()
    warm = prompt_token_ids(rt.tokenizer, WARM_PROMPTS, args.prompt_tokens)
    run_skistune(rt, warm, 4), run_transformers(hf, warm, 4)

    rows = []
    print(f"torch threads: {torch.get_num_threads()}, prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, greedy, fp32, median of {max(1, args.repeats)} alternating runs")
    print(f"{'batch':>5} {'skistune tok/s':>15} {'transformers tok/s':>19} {'ratio':>6} {'identical':>10}")
    for b in args.batch_sizes:
        prompts = prompt_token_ids(rt.tokenizer, b, args.prompt_tokens)
        ours_s, theirs_s = [], []
        for _ in range(max(1, args.repeats)):
            t_ours, ours = run_skistune(rt, prompts, args.new_tokens)
            t_hf, theirs = run_transformers(hf, prompts, args.new_tokens)
            ours_s.append(t_ours)
            theirs_s.append(t_hf)
        t_ours, t_hf = statistics.median(ours_s), statistics.median(theirs_s)
        same = sum(a == t for a, t in zip(ours, theirs)) / b
        row = dict(batch=b, skistune_tok_per_s=b * args.new_tokens / t_ours,
                   transformers_tok_per_s=b * args.new_tokens / t_hf, ratio=t_hf / t_ours,
                   identical_fraction=same, skistune_runs_s=ours_s, transformers_runs_s=theirs_s)
        rows.append(row)
        print(f"{b:>5} {row['skistune_tok_per_s']:>15.1f} {row['transformers_tok_per_s']:>19.1f} "
              f"{row['ratio']:>6.2f} {same:>10.0%}")
    if args.json:
        print_json({"benchmark": "runtime_throughput", "torch_threads": torch.get_num_threads(),
                    "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                    "repeats": max(1, args.repeats), "rows": rows})


if __name__ == "__main__":
    main()
