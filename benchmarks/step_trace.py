"""Where a runtime step's time goes, by torch.profiler: host time, GPU kernels, launches and syncs per step.

Decode steps and prefill chunks of the real runtime are timed as the profiler times them
(`skistune.profile.steps.StepBench`), then run again under ``torch.profiler``.

For each point it prints the step's wall time, the host time inside the model step (the forward pass and
sampling, waits for the GPU included), and on a GPU: the time the GPU spent in kernels (summed over the
step's kernels, so ``busy`` is the share of the step during which a kernel ran, at most), the kernels
launched and the host-device synchronisations per step. Then the operators that took the most host time,
and on a GPU the kernels that took the most GPU time.
A GPU step whose kernels fill a small part of its wall time is bound by the host (Python and launches):
CUDA graphs or fewer, larger kernels are the fix, not faster kernels.

    python benchmarks/step_trace.py [--model llama-3-8b] [--device cuda] [--points decode:1x1024 ...]
                                    [--steps 5] [--top 12] [--json]
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench_args import add_json, check_device, check_runtime, description, fail, positive_int, print_json

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from skistune.config import KVConfig
from skistune.profile.measure import DTYPES
from skistune.profile.steps import SETUP_TOKENS, StepBench, fill_kv
from skistune.runtime.kv_layout import kv_traffic
from skistune.runtime.llm import Runtime
from skistune.runtime.presets import PRESETS

MARK = "skistune.model_step"
WARMUP = 2  # untimed steps before a point's timed ones
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
HOST_COPIES = ("aten::item", "aten::_local_scalar_dense")  # a tensor's value read on the host: waits for the GPU


@dataclass(frozen=True)
class Point:
    kind: str  # decode or prefill
    a: int  # decode: batch; prefill: chunk tokens
    b: int  # decode: context; prefill: cached tokens

    def __str__(self) -> str:
        return f"{self.kind}:{self.a}x{self.b}"

    def tokens(self, steps: int) -> int:
        """KV tokens the point holds at most, with room for its decode steps."""
        return self.a * self.longest(steps) if self.kind == "decode" else self.a + self.b + 32

    def longest(self, steps: int) -> int:
        """The longest sequence the point makes: a decode's prompt, its setup steps (`StepBench` prefills the
        batch 4,096 tokens a step) and its decode steps, with room to spare; a prefill's chunk, context and the
        token it samples."""
        if self.kind == "prefill":
            return self.a + self.b + 1  # (the chunk ends its prompt, so it samples a token)
        return self.b + -(-self.a * self.b // SETUP_TOKENS) + steps + 32


def point(text: str) -> Point:
    """``decode:BATCHxCONTEXT`` or ``prefill:CHUNKxCACHED`` (cached a multiple of chunk, as the profiler's)."""
    try:
        kind, rest = text.split(":")
        a, b = (int(x) for x in rest.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected decode:BATCHxCONTEXT or prefill:CHUNKxCACHED") from None
    if kind not in ("decode", "prefill") or a < 1 or b < 0 or (kind == "decode" and b < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: expected decode:BATCHxCONTEXT or prefill:CHUNKxCACHED, "
                                         "sizes 1 or more (cached tokens 0 or more)")
    if kind == "prefill" and b % a:
        raise argparse.ArgumentTypeError(f"{text!r}: the cached tokens must be a multiple of the chunk")
    return Point(kind, a, b)


def run_point(bench: StepBench, p: Point):
    return bench.decode(p.a, p.b) if p.kind == "decode" else bench.prefill(p.a, p.b)


def _device_us(event) -> float:
    """An event's own time on the device, in µs (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def traced(bench: StepBench, p: Point, top: int) -> dict:
    """One more measurement of ``p`` under torch.profiler: per model step, the host time, kernel time,
    launches and synchronisations, and the ``top`` operators by host time."""
    runner = bench.recorder.runner
    plain = runner.execute

    def marked(out, kv):
        with record_function(MARK):
            return plain(out, kv)

    cuda = bench.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runner.execute, warmup = marked, bench.warmup
    bench.warmup = 0  # (the untraced run of the same point warmed it: every traced step is a timed one)
    try:
        with profile(activities=activities) as prof:
            run_point(bench, p)
    finally:
        runner.execute, bench.warmup = plain, warmup
    events = prof.events()
    marks = [e for e in events if e.name == MARK]
    steps = len(marks)
    inside = [e for e in events if e.name != MARK and any(
        m.time_range.start <= e.time_range.start and e.time_range.end <= m.time_range.end for m in marks)]
    kernel_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels_us = sum(e.time_range.elapsed_us() for e in kernel_events)
    by_kernel: dict[str, list] = {}
    for e in kernel_events:
        row = by_kernel.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.elapsed_us()
    top_kernels = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    count = lambda names: sum(e.name in names for e in inside) / steps  # noqa: E731
    table = {}
    for e in inside:
        if e.device_type == torch.autograd.DeviceType.CPU:
            row = table.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.self_cpu_time_total
    ops = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
    return {"model_steps": steps, "host_ms": sum(m.cpu_time_total for m in marks) / steps / 1e3,
            "kernel_ms": kernels_us / steps / 1e3 if cuda else None,
            "launches": count(LAUNCHES) if cuda else None, "syncs": count(SYNCS) if cuda else None,
            "host_reads": count(HOST_COPIES),
            "ops": [{"op": name, "calls": n / steps, "self_host_ms": us / steps / 1e3} for name, (n, us) in ops],
            "kernels": [{"kernel": name, "calls": n / steps, "device_ms": us / steps / 1e3}
                        for name, (n, us) in top_kernels]}


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--model", default=None, choices=list(PRESETS),
                    help="default llama-3-8b on cuda, smollm2-135m on cpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=list(DTYPES))
    ap.add_argument("--points", nargs="+", type=point, metavar="KIND:AxB",
                    default=[point("decode:1x1024"), point("decode:64x1024"), point("prefill:512x0")])
    ap.add_argument("--steps", type=positive_int, default=5, help="timed steps per point")
    ap.add_argument("--top", type=positive_int, default=12, help="operators listed per point")
    add_json(ap)
    args = ap.parse_args()
    check_device(args.device)
    model = args.model or ("llama-3-8b" if args.device == "cuda" else "smollm2-135m")
    dtype = DTYPES[args.device]
    spec = PRESETS[model]
    check_runtime(model, args.device)
    steps = args.steps + 2 * WARMUP
    for p in args.points:
        if p.longest(steps) > spec.max_context:
            fail(f"--points {p}: sequences of up to {p.longest(steps)} tokens, more than {model}'s context of "
                 f"{spec.max_context}")
    per_token = kv_traffic(KVConfig(), spec, dtype.itemsize).bytes_per_token
    pool = max(p.tokens(steps) for p in args.points) * per_token
    try:
        runtime = Runtime.from_preset(model, KVConfig().with_knobs({"offload.device_kv_bytes": pool}),
                                      device=args.device, dtype=dtype)
    except ValueError as exc:  # (a pool larger than this machine's memory)
        fail(f"--points {' '.join(map(str, args.points))}: {exc}")
    fill_kv(runtime)
    bench = StepBench(runtime, warmup=WARMUP, repeats=args.steps, max_repeats=args.steps, min_time_s=0.0)
    rows = []
    print(f"{model} on {args.device} ({dtype}), torch {torch.__version__}")
    for p in args.points:
        wall_ms = run_point(bench, p).timing.median_s * 1e3
        row = {"point": str(p), "wall_ms": wall_ms, **traced(bench, p, args.top)}
        rows.append(row)
        line = f"{str(p):<18} step {wall_ms:8.2f} ms wall, {row['host_ms']:8.2f} ms host in the model step"
        if row["kernel_ms"] is not None:
            line += (f", GPU kernels {row['kernel_ms']:.2f} ms (busy at most {row['kernel_ms'] / wall_ms:.0%}), "
                     f"{row['launches']:.0f} launches, {row['syncs']:.1f} syncs")
        print(line + f", {row['host_reads']:.1f} host reads of a tensor per step")
        for op in row["ops"]:
            print(f"    {op['op'][:60]:<60} {op['calls']:7.1f} calls {op['self_host_ms']:8.3f} ms host")
        for k in row["kernels"]:
            print(f"    kernel {k['kernel'][:53]:<53} {k['calls']:7.1f} calls {k['device_ms']:8.3f} ms on the GPU")
    if args.json:
        print_json({"benchmark": "step_trace", "model": model, "device": args.device, "dtype": str(dtype),
                    "torch": torch.__version__, "steps": args.steps, "points": rows})


if __name__ == "__main__":
    main()
