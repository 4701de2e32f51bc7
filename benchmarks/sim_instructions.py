"""Simulator cost in CPU instructions, two revisions side by side: a deterministic figure on a machine whose
speed moves (a shared 2-core VM read the same code 20-30% apart from one run to the next in wall time).

Each revision (a git revision, or ``WT`` for the working tree) is laid out as the installed package in a
temporary folder and replays the workload under valgrind's callgrind, counting only the last replay
(instrumentation is switched on around it), so imports, the profile and the workload's preparation are
left out. With ``--replays 2`` the counted replay is a repeat, as a search's trials after its first are.
Needs valgrind; under it a replay runs about 50x slower, so keep ``--requests`` in the thousands.

    python benchmarks/sim_instructions.py --base HEAD~3 [--new WT] [--workload azure-conv|mooncake-conv|chat]
        [--rate-scale 0.01] [--requests 3000] [--replays 2] [--config FILE] [--json]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_args import add_json, description, fail, hardware_profile, positive_float, positive_int, print_json

from skistune.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / ".." / "shared" / "traces"
WORKLOADS: dict[str, Path | str] = {
    "azure-conv": TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv",
    "mooncake-conv": TRACES / "mooncake_conversation" / "conversation_trace.head.jsonl",
    "chat": "chat",  # the preset `skistune optimize` searches by default: sessions whose turns share prefixes
}
# the repository's folders and where the installed package has them (pyproject.toml's package-dir)
LAYOUT = {"skistune": "", "runtime": "runtime", "kernels": "kernels", "searchspace": "searchspaces",
          "profiles": "profiles"}

# run inside valgrind: replays the workload, instrumenting only the last replay
REPLAY = """
import os, subprocess, sys, warnings
warnings.simplefilter("ignore")
from skistune.config import KVConfig, load_config
from skistune.evaluate import sim_target, workload_requests
from skistune.simulator import build_engine, with_rate_scale
from skistune.workloads import load_workload
path, scale, n, replays, profile = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
config = load_config(sys.argv[6]) if sys.argv[6] else KVConfig()
target = sim_target("smollm2-135m", profile)
requests = with_rate_scale(workload_requests(load_workload(path), "smollm2-135m")[:n], scale)
for i in range(replays):
    engine, _ = build_engine(config, target)
    last = i == replays - 1
    if last:
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True, check=True)
    metrics = engine.replay(requests)
    if last:
        subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], capture_output=True, check=True)
import skistune
assert skistune.__file__.startswith(os.environ["PYTHONPATH"]), skistune.__file__
print(metrics.duration_s, metrics.output_tokens)
"""


def package_at(rev: str, dest: Path) -> Path:
    """The package as installed, from git revision ``rev`` (``WT``: the working tree), under ``dest``."""
    src = dest / "src"
    src.mkdir(parents=True)
    if rev == "WT":
        for folder in LAYOUT:
            shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *LAYOUT], capture_output=True)
        if archive.returncode:
            fail(f"--base/--new {rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    pkg = dest / "pkg" / "skistune"
    for folder, inside in LAYOUT.items():
        shutil.copytree(src / folder, pkg / inside if inside else pkg, dirs_exist_ok=True)
    return dest / "pkg"


def check_revision(option: str, rev: str) -> None:
    """``WT`` or a git revision that names a commit of this repository (read only: ``git rev-parse``)."""
    if rev == "WT":
        return
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", "--end-of-options",
                            f"{rev}^{{commit}}"], capture_output=True, text=True)
    if found.returncode:
        fail(f"{option} {rev}: not a git revision of this repository (nor WT, the working tree)")


def count(rev: str, args, tmp: Path) -> dict:
    name = re.sub(r"\W", "_", rev)  # (a folder and a file name per revision: both run at once)
    pythonpath = package_at(rev, tmp / name)
    out_file = tmp / f"callgrind.{name}"
    run = subprocess.run(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}", sys.executable,
         "-c", REPLAY, str(WORKLOADS[args.workload]), str(args.rate_scale), str(args.requests), str(args.replays),
         args.profile, args.config or ""],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(pythonpath)},
        cwd=tmp)  # (not the repository: ``-c`` puts the working folder, and its skistune/, first on the path)
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode or not found:
        fail(f"{rev}: the replay under valgrind failed: {run.stderr.strip().splitlines()[-1:]}")
    duration_s, tokens = run.stdout.split()
    return {"rev": rev, "instructions": int(found.group(1)), "simulated_duration_s": float(duration_s),
            "output_tokens": int(tokens)}


def add_revision_args(ap: argparse.ArgumentParser, workload: str) -> None:
    """The options of a side-by-side measurement of two revisions (this benchmark's and `sim_memory`'s)."""
    ap.add_argument("--base", required=True, help="git revision to compare against (or WT)")
    ap.add_argument("--new", default="WT", help="git revision measured against it (default: the working tree)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=workload)
    ap.add_argument("--rate-scale", type=positive_float, default=0.01)
    ap.add_argument("--profile", type=hardware_profile, default=str(ROOT / "profiles" / "cpu-smollm2-135m.json"))


def check_revision_args(args) -> None:
    """Every input checked before either revision runs: a bad revision found by `git archive` in one thread had
    printed its error at once, and the process then waited for the other revision's replay (a minute) to exit."""
    if args.base == args.new:
        fail(f"--base and --new are both {args.base}")
    for option, rev in (("--base", args.base), ("--new", args.new)):
        check_revision(option, rev)
    if isinstance(WORKLOADS[args.workload], Path) and not WORKLOADS[args.workload].is_file():
        fail(f"--workload {args.workload}: no trace sample at {WORKLOADS[args.workload]}")
    args.profile = str(Path(args.profile).resolve())  # (the revisions run in a temporary folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    add_revision_args(ap, "azure-conv")
    ap.add_argument("--requests", type=positive_int, default=3000, help="the workload's first N requests")
    ap.add_argument("--replays", type=positive_int, default=2, help="the last is counted (2: a repeat)")
    ap.add_argument("--config", metavar="FILE", help="a KV config file both revisions replay (default: every knob's "
                    "default)")
    add_json(ap)
    args = ap.parse_args()
    check_revision_args(args)
    if args.config:
        try:
            load_config(args.config)
        except (OSError, ValueError) as exc:
            fail(f"--config {args.config}: {exc}")
        args.config = str(Path(args.config).resolve())  # (the revisions run in a temporary folder)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        fail("needs valgrind (callgrind and callgrind_control): apt-get install valgrind")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:  # both at once: counts are exact
        base, new = pool.map(lambda rev: count(rev, args, Path(tmp)), [args.base, args.new])
    same = (base["simulated_duration_s"], base["output_tokens"]) == (new["simulated_duration_s"], new["output_tokens"])
    ratio = new["instructions"] / base["instructions"]
    print(f"{args.workload}, first {args.requests} requests at rate x{args.rate_scale:g}, replay {args.replays} "
          f"of {args.replays} counted" + (f", config {args.config}" if args.config else ""))
    for row in (base, new):
        print(f"  {row['rev']:<12} {row['instructions']:>16,} instructions   simulated {row['simulated_duration_s']:,.1f} s")
    print(f"  {args.new} / {args.base}: x{ratio:.3f} the instructions"
          + ("" if same else "  (the two predicted different runs: not the same work)"))
    if args.json:
        print_json({"benchmark": "sim_instructions", "workload": args.workload, "rate_scale": args.rate_scale,
                    "requests": args.requests, "replays": args.replays, "config": args.config, "base": base, "new": new,
                    "ratio": ratio, "same_prediction": same})


if __name__ == "__main__":
    main()
