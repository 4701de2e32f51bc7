"""Run a quality grid on the real model and write the profile; score configs on held-out windows.

Measurements are written to the output file as they finish, so an interrupted run resumes where it stopped
(``resume=True`` keeps every measurement of the file that was taken with the same corpus and protocol).
"""
from __future__ import annotations

import datetime
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

from skistune.config import KVConfig
from skistune.paths import write_atomic
from skistune.quality.corpus import Corpus
from skistune.quality.grid import Grid, Measurement
from skistune.quality.model import FORMAT, VERSION, QualityProfile, knob_key, loss_metric
from skistune.quality.scoring import SCORING_CHUNK, needle_found, needle_trials, scoring_config, window_nll

Progress = Callable[[str, int, int], None]  # (what, done, total)
HELD_OUT_NEEDLE = ((1024, 0.3), (2048, 0.6))  # placements and (seed 1) keys no profile uses


def _protocol(grid: Grid) -> dict:
    return {"grid": grid.name, "windows": grid.windows, "continuation": grid.continuation, "chunk": SCORING_CHUNK,
            "needle_placements": [list(p) for p in grid.needle_placements]}


def _window_losses(runtime, config: KVConfig, windows: list[list[int]], continuation: int) -> dict:
    rt = runtime.with_config(scoring_config(config))
    nll, nll_all = [], []
    for w in windows:
        x = window_nll(rt, w, continuation)
        nll.append(x[-continuation:].mean().item())
        nll_all.append(x.mean().item())
    return {"nll": nll, "nll_all_positions": nll_all}


def _needle(runtime, config: KVConfig, trials) -> list[bool]:
    rt = runtime.with_config(scoring_config(config))
    return [needle_found(rt, t) for t in trials]


RESUMED_FIELDS = ("format", "version", "model", "corpus", "protocol")  # a file's measurements are kept when all agree


def _load_resumable(out: Path, header: dict) -> dict:
    """The measurements already in ``out`` (none where it does not exist). A file that is not a profile of the same
    model, corpus and protocol is refused rather than replaced by the first measurement: a full profile (hours of
    measuring) had been overwritten by a quick run, or on another Python version (another corpus), in silence."""
    if not out.exists():
        return {}
    what = None
    try:
        old = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        old, what = None, f"is not a quality profile ({getattr(exc, 'strerror', None) or 'not JSON'})"
    if what is None and (not isinstance(old, dict) or old.get("format") != header["format"]):
        what = "is not a quality profile"
    if what is None:
        differs = [_difference(k, old.get(k), header[k]) for k in RESUMED_FIELDS if old.get(k) != header[k]]
        if not differs:
            return old
        what = f"holds a quality profile measured with {'; '.join(differs)}, so its measurements cannot be resumed"
    raise ValueError(f"quality profile {out}: {what}; measuring would replace it: pass --fresh (in Python: "
                     "resume=False) to measure everything again over it, or --out another file")


def _difference(field: str, old, new) -> str:
    """How a file's header field differs from this run's, in words."""
    if field == "corpus" and isinstance(old, dict) and old.get("python") != new.get("python"):
        return f"Python {old.get('python')}'s docstrings, not this Python's {new.get('python')}"
    if field == "protocol" and isinstance(old, dict) and old.get("grid") != new.get("grid"):
        return f"the {old.get('grid')} grid, not the {new.get('grid')} grid"
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in new if old.get(k) != new[k]]
        return f"another {field} ({', '.join(f'{k} {old.get(k)!r}, not {new[k]!r}' for k in keys)})"
    return f"another {field} ({old!r}, not {new!r})"


def _write(out: Path, data: dict) -> None:
    write_atomic(out, json.dumps(data, indent=1) + "\n")  # (whole or not at all; no stray temporary file)


def build_profile(runtime, grid: Grid, out: str | Path, *, resume: bool = True,
                  progress: Progress | None = None, note: Callable[[str], None] | None = None) -> QualityProfile:
    """Measure ``grid`` with ``runtime`` (a real-weight model) and write the profile to ``out``; ``note`` is
    told, in a line, when measurements already in ``out`` are kept (a resumed run)."""
    if runtime.tokenizer is None:
        raise ValueError(f"model {runtime.spec.name} has no real weights: quality is measured on a real model "
                         "(smollm2-135m)")
    out = Path(out)
    corpus = Corpus.stdlib(runtime.tokenizer, grid.window_tokens)
    windows = corpus.windows("profile", grid.windows)
    header = {"format": FORMAT, "version": VERSION, "model": runtime.spec.name, "n_layers": runtime.spec.n_layers,
              "corpus": corpus.describe(), "protocol": _protocol(grid)}
    data = (_load_resumable(out, header) if resume else {}) or {**header, "perplexity": {}, "needle": {}}
    data.setdefault("measured_s", 0.0)
    ppl_todo = [m for m in grid.perplexity(runtime.spec.n_layers) if knob_key(m.knobs) not in data["perplexity"]]
    trials = needle_trials(grid.needle_placements)
    needle_todo = [m for m in grid.needle() if knob_key(m.knobs) not in data["needle"]]
    total, done = len(ppl_todo) + len(needle_todo), 0
    kept = len(data["perplexity"]) + len(data["needle"])
    if note and kept:
        note(f"resuming {out}: {kept} measurements kept, {total} to take (--fresh measures everything again)")
    for m in ppl_todo + needle_todo:
        if progress:
            progress(_label(m), done, total)
        t0 = time.perf_counter()
        config = KVConfig().with_knobs(m.knobs)
        if m.kind.startswith("needle"):
            data["needle"][knob_key(m.knobs)] = {"kind": m.kind, "knobs": m.knobs, "found": _needle(runtime, config, trials)}
        else:
            data["perplexity"][knob_key(m.knobs)] = {"kind": m.kind, "knobs": m.knobs,
                                                     **_window_losses(runtime, config, windows, grid.continuation)}
        data["measured_s"] += time.perf_counter() - t0
        done += 1
        data["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        data["torch"] = torch.__version__
        _write(out, data)
    if progress:
        progress("done", done, total)
    profile = QualityProfile(data, str(out))
    data["combination"] = profile.combination_checks()
    _write(out, data)
    return QualityProfile(data, str(out))


def _label(m: Measurement) -> str:
    knobs = ", ".join(f"{k.split('.')[1]}={v}" for k, v in m.knobs.items() if k != "bitwidth.layer_bits")
    if "bitwidth.layer_bits" in m.knobs:
        knobs = (knobs + ", " if knobs else "") + "per-layer bits"
    return f"{m.kind} {knobs}".strip()


def measure_quality(runtime, configs: list[KVConfig], *, windows: int = 2, window_tokens: int = 1024,
                    continuation: int = 64, needle: bool = False,
                    progress: Progress | None = None) -> list[dict]:
    """Measured loss of each config against the full cache on HELD-OUT windows (never in a profile):
    relative perplexity increase, mean and worst window, and, with ``needle``, the passkey share kept."""
    corpus = Corpus.stdlib(runtime.tokenizer, window_tokens)
    texts = corpus.windows("heldout", windows)
    full = _window_losses(runtime, KVConfig(), texts, continuation)
    trials = needle_trials(HELD_OUT_NEEDLE, seed=1) if needle else []
    full_found = sum(_needle(runtime, KVConfig(), trials)) if needle else 0
    out = []
    for i, config in enumerate(configs):
        if progress:
            progress(f"held-out quality {i + 1}/{len(configs)}", i, len(configs))
        metric = loss_metric(config.eviction.policy)
        nll = _window_losses(runtime, config, texts, continuation)[metric]
        deltas = [c - f for c, f in zip(nll, full[metric])]
        row = {"ppl_mean": max(0.0, math.exp(sum(deltas) / len(deltas)) - 1),
               "ppl_worst": max(0.0, max(math.exp(d) - 1 for d in deltas))}
        if needle:
            row["needle_retained"] = min(1.0, sum(_needle(runtime, config, trials)) / full_found) if full_found else None
        out.append(row)
    return out
