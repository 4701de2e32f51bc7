"""Helpers the engine exporters share: KV widths an engine has, sizes in the engines' units, the knobs
engines fix (eviction, per-group scales), YAML and shell rendering."""
from __future__ import annotations

import shlex
from typing import Any, Callable

import yaml

from skistune.export.base import EVICTION_DETAILS, Plan
from skistune.runtime.presets import ModelSpec

GIB = 1 << 30
GB = 10**9

# The Hugging Face repositories of the model presets' architectures, for the `MODEL` of a command line.
# Presets are shapes; these ids are the usual instruct checkpoints of those shapes (edit the command if
# you serve another checkpoint of the same shape).
HF_REPOS = {
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
}


def model_id(model: ModelSpec) -> str:
    return HF_REPOS.get(model.name, model.name)


def listed(items: list[str]) -> str:
    """``a, b and c``: items in a sentence."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def round_up_width(bits: int, widths: tuple[int, ...]) -> int:
    """The narrowest width the engine has that is at least ``bits`` (never less precise than asked)."""
    wider = [w for w in sorted(widths) if w >= bits]
    return wider[0] if wider else max(widths)


def single_kv_bits(plan: Plan, widths: tuple[int, ...], label: Callable[[int], str], others: str = "") -> int:
    """One KV width for all layers, keys and values alike (the engines here have one KV dtype): the
    widest the config asks for, rounded up to a width the engine has (never less precise than asked).
    ``others`` says why the engine's other, narrower dtypes are not used. Accounts for the bit knobs."""
    bw = plan.config.bitwidth
    have = "the dtypes written are " + ", ".join(f"{w}-bit {label(w)}" for w in sorted(widths, reverse=True)) + others
    if bw.layer_bits is not None:
        got = round_up_width(max(b for pair in bw.layer_bits for b in pair), widths)
        if any(b != got for pair in bw.layer_bits for b in pair):
            plan.instead("bitwidth.layer_bits", f"{label(got)} for every layer",
                         f"{plan.engine} has one KV dtype for all layers and for keys and values ({have}); "
                         "the widest asked for, rounded up")
        else:
            plan.express("bitwidth.layer_bits")
        return got
    got = round_up_width(max(bw.key_bits, bw.value_bits), widths)
    for knob, bits in (("bitwidth.key_bits", bw.key_bits), ("bitwidth.value_bits", bw.value_bits)):
        if bits == got:
            plan.express(knob)
        elif bits in widths:
            plan.instead(knob, label(got), f"{plan.engine} has one KV dtype for keys and values; the wider one")
        else:
            plan.instead(knob, label(got), f"{plan.engine} has no {bits}-bit KV ({have}); the nearest wider")
    return got


def fixed_scaling(plan: Plan, how: str) -> None:
    """Engines' KV dtypes carry their own scales and keep no full-precision window. ``group_size`` 32 (the
    default, which the engine search spaces fix) stands for "the engine's own scaling"; any other group
    size is reported."""
    plan.fixed("bitwidth.group_size", 32, f"{plan.engine} has no group-size setting ({how})",
               written=f"the engine's scaling ({how})")
    plan.fixed("bitwidth.full_precision_window", 0, f"{plan.engine} quantizes every token of the KV cache",
               written="0 (no full-precision window)")


def fp8_scales_note(plan: Plan, how: str) -> None:
    """The caveat of every fp8 KV export: skistune priced 8-bit KV by its own int8 quantization in groups of
    32 (docs/quality.md), the engines scale fp8 per tensor (1.0 unless calibrated), so the quality measured
    carries over only with calibrated scales. ``how`` says how the engine gets them. A note, not a warning:
    the dtype is the nearest the engine has (group_size 32 stands for its scaling, `fixed_scaling`)."""
    plan.notes.append("KV is written as fp8, whose scales are per tensor (1.0 unless calibrated), while skistune "
                      "priced 8-bit KV by its own int8 quantization in groups of 32 (docs/quality.md): the quality "
                      f"measured holds only with calibrated scales; {how}")


def tiers_without_prefix_reuse(plan: Plan, written: str, tier: str, disk: bool = True) -> bool:
    """Warn about a host (or, with ``disk``, a disk) tier in a config whose prefix reuse is off: skistune's
    tiers hold cached prefixes and serve only prefix-reuse hits, so its tuned run never used them, while the
    engine's tier (``tier`` says how) serves prefix-cache hits; ``written`` is what the file holds. The one
    check of every exporter (``disk`` False where the exporter writes no disk tier). True if it warned."""
    off = plan.config.offload
    if plan.value("prefix_reuse.enabled") or not (off.host_kv_bytes or (disk and off.disk_kv_bytes)):
        return False
    plan.instead("prefix_reuse.enabled", written, f"{tier}; skistune's host and disk tiers serve only prefix-reuse "
                 "hits, so with prefix reuse off the tuned run never used them (turn prefix reuse on, or set the "
                 "tiers to 0)")
    return True


def no_eviction(plan: Plan, why: str) -> None:
    """For engines that keep every token of a running sequence: policy none is expressed, any other
    policy (with its budget, sinks, window and schedule) is one warning."""
    if plan.value("eviction.policy") == "none":
        plan.express("eviction.policy")
        return
    plan.instead("eviction.policy", "no eviction (every token kept)", why, related=EVICTION_DETAILS)


SIZE_DIGIT = 0.001  # sizes in GiB/GB are written with three decimals
ROUNDING_TOLERANCE = 0.02  # a written size within 2% of the asked one is the same setting


def size_in(bytes_: int, unit: int) -> float:
    """A byte count in GiB/GB with three decimals (at least 0.001, so a small pool stays on)."""
    return max(round(bytes_ / unit, 3), SIZE_DIGIT)


def size_differs(asked: int, written: float, digit: float = 0) -> bool:
    """Whether a size written in an engine's unit (``written``, back in bytes) is not the ``asked`` one: off
    by more than ROUNDING_TOLERANCE of it and by more than the rounding of its last printed digit (``digit``
    bytes, half of which a written value may be off). ``digit`` is 0 where the engine itself takes whole
    units (SGLang's GB, vLLM's blocks): any rounding beyond the tolerance is then the engine's, not ours."""
    return abs(written - asked) > max(ROUNDING_TOLERANCE * asked, digit / 2)


def size_setting(plan: Plan, knob: str, unit: int, name: str) -> float:
    """``knob``'s byte size as ``name`` in GiB (``unit`` GIB) or GB with three decimals (`size_in`), expressed,
    or warned about where that is not the asked size: a pool smaller than 0.001 of the unit is written as
    0.001, so that the tier stays on."""
    asked = plan.value(knob)
    size = size_in(asked, unit)
    if size_differs(asked, size * unit, SIZE_DIGIT * unit):
        unit_name = "GiB" if unit == GIB else "GB"
        plan.instead(knob, f"{name} {size} ({round(size * unit)} bytes)", f"{name} is in {unit_name}, written "
                     f"with three decimals: a smaller pool is written as the smallest, {SIZE_DIGIT}, to keep the "
                     "tier on")
    else:
        plan.express(knob)
    return size


class _Dumper(yaml.SafeDumper):
    """Block style for mappings, flow style for lists of scalars (a per-layer list stays one line)."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (list, dict)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump_yaml(data: dict[str, Any], header: str) -> str:
    """Deterministic YAML (insertion order) under a comment header."""
    return comment(header) + yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                                       width=1 << 16)


def comment(text: str) -> str:
    """``text`` as YAML comment lines."""
    return "".join(f"# {line}\n" if line else "#\n" for line in text.splitlines())


def command_line(words: list[str], flags: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> str:
    """A shell command line: ``env`` assignments, ``words`` (program, arguments, paths) and ``flags``
    (`shell_args`), every value shell-quoted so the line can be pasted as printed (a path with a space
    stays one argument)."""
    assignments = [f"{key}={shlex.quote(str(value))}" for key, value in (env or {}).items()]
    return " ".join([*assignments, *(shlex.quote(str(w)) for w in words), *shell_args(flags or {})])


def shell_args(flags: dict[str, Any]) -> list[str]:
    """``--key value`` pairs as argparse-style engines read them: ``true`` is the bare flag, lists are
    several values; values are shell-quoted."""
    out: list[str] = []
    for key, value in flags.items():
        if value is False or value is None:
            continue
        out.append(f"--{key}")
        if value is True:
            continue
        values = value if isinstance(value, list) else [value]
        out.extend(shlex.quote(str(v)) for v in values)
    return out
