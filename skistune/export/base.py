"""The exporter contract: what every target produces and how it accounts for every knob.

An exporter turns one `KVConfig` into the target's own file (and, where the target has one, the equivalent
command line) for one engine version. It must account for every knob that matters in the config
(`relevant_knobs`): each is either *expressed* (written, or matched by the engine's fixed behaviour) or
*warned about* (an `ExportWarning` naming the knob, its value and the nearest setting written instead).
Knobs outside a target's scope (an LMCache file holds no batching knobs) are listed in
`ExportResult.out_of_scope` instead: they belong to another export, not to a warning. A knob an exporter
does not map yet (one just added to `KVConfig`) is reported by a generic warning when it is off its default
(`Plan.account_unmapped`), so nothing is dropped silently; the contract tests require every exporter to
map every knob explicitly.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from skistune.config import KVConfig, byte_size_text, knob_fields
from skistune.runtime.presets import ModelSpec

EVICTION_DETAILS = ("eviction.budget_tokens", "eviction.budget_fraction", "eviction.sink_tokens",
                    "eviction.recent_window", "eviction.layer_schedule")
TIER_DETAILS = ("offload.demote_first", "offload.write_policy", "prefetch.enabled")


def show(value: Any, knob: str | None = None) -> str:
    """A knob value as it is written in a config file: strings bare, byte sizes of ``knob`` as ``8GiB``, other
    values as JSON (tuples as lists)."""
    size = byte_size_text(knob, value) if knob is not None else None
    if size is not None:
        return size
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        items = [json.dumps(list(v) if isinstance(v, tuple) else v) for v in value]
        # per-layer lists run to dozens of pairs: a message shows the first few and the count
        return f"[{', '.join(items)}]" if len(items) <= 4 else f"[{', '.join(items[:3])}, ... ({len(items)} in all)]"
    return json.dumps(value)


@dataclass(frozen=True)
class ExportWarning:
    """A knob the target cannot express: its value, the nearest setting written instead, and why.
    ``related`` names further knobs the same approximation covers (an eviction policy's budget)."""

    knob: str
    value: Any
    written: str
    reason: str
    related: tuple[str, ...] = ()

    def knobs(self) -> tuple[str, ...]:
        return (self.knob, *self.related)

    def __str__(self) -> str:
        also = f" (also covers {', '.join(self.related)})" if self.related else ""
        return f"{self.knob}={show(self.value, self.knob)}: {self.reason}; wrote {self.written}{also}"

    def to_dict(self) -> dict[str, Any]:
        value = [list(v) if isinstance(v, tuple) else v for v in self.value] if isinstance(self.value, tuple) \
            else self.value
        return {"knob": self.knob, "value": value, "written": self.written, "reason": self.reason,
                "related": list(self.related), "message": str(self)}


@dataclass(frozen=True)
class Companion:
    """A second file that an export's command line needs (vLLM's LMCache configuration, which the command
    names in LMCACHE_CONFIG_FILE): the target that writes the same file alone (``--to lmcache``), its
    version, the name the command gives it and its text."""

    target: str
    engine_version: str
    file_name: str
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "engine_version": self.engine_version, "file_name": self.file_name,
                "text": self.text}


@dataclass(frozen=True)
class ExportResult:
    """One export: the file text, the command line (None where the target has none), the warnings,
    notes (approximations within tolerance, companion steps), the non-default knobs out of scope, and the
    companion files the command needs beside the file."""

    target: str
    engine_version: str
    text: str
    command: str | None
    warnings: tuple[ExportWarning, ...]
    notes: tuple[str, ...]
    out_of_scope: tuple[str, ...]
    expressed: tuple[str, ...]
    file_format: str = "yaml"
    companions: tuple[Companion, ...] = ()

    def warned_knobs(self) -> frozenset[str]:
        return frozenset(k for w in self.warnings for k in w.knobs())

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "engine_version": self.engine_version, "command": self.command,
                "warnings": [w.to_dict() for w in self.warnings], "notes": list(self.notes),
                "out_of_scope": list(self.out_of_scope), "text": self.text,
                "companions": [c.to_dict() for c in self.companions]}


@dataclass(frozen=True)
class EngineVersion:
    """One engine version an exporter supports, with where its facts come from."""

    name: str
    source: str
    facts: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __getitem__(self, key: str) -> Any:
        return self.facts[key]


def relevant_knobs(config: KVConfig) -> frozenset[str]:
    """The knobs whose value changes behaviour in this config: a budget means nothing without an eviction
    policy, a group size nothing at 16 bits, a write policy nothing without a host or disk tier."""
    drop: set[str] = set()
    ev, bw, off, pf, b = config.eviction, config.bitwidth, config.offload, config.prefetch, config.batching
    if ev.policy == "none":
        drop.update(EVICTION_DETAILS)
    else:
        drop.add("eviction.budget_fraction" if ev.budget_tokens is not None else "eviction.budget_tokens")
    pairs = bw.layer_bits if bw.layer_bits is not None else ((bw.key_bits, bw.value_bits),)
    drop.update(("bitwidth.key_bits", "bitwidth.value_bits") if bw.layer_bits is not None
                else ("bitwidth.layer_bits",))
    if all(bits == 16 for pair in pairs for bits in pair):
        drop.update(("bitwidth.group_size", "bitwidth.full_precision_window"))
    drop.add("offload.device_memory_fraction" if off.device_kv_bytes is not None else "offload.device_kv_bytes")
    if not (off.host_kv_bytes or off.disk_kv_bytes):
        drop.update(TIER_DETAILS)
    if not (pf.enabled and (off.host_kv_bytes or off.disk_kv_bytes)):
        drop.update(("prefetch.depth", "prefetch.unit"))
    if not b.chunked_prefill:
        drop.add("batching.chunk_size")
    return frozenset(set(knob_fields()) - drop)


def knob_value(config: KVConfig, knob: str) -> Any:
    family, _, name = knob.partition(".")
    return getattr(getattr(config, family), name)


def is_default(config: KVConfig, knob: str) -> bool:
    return knob_value(config, knob) == knob_fields()[knob].default


class Plan:
    """The bookkeeping of one export: which knobs were expressed and which were approximated."""

    def __init__(self, config: KVConfig, engine: str, scope: frozenset[str],
                 provenance: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.provenance = provenance or {}  # a tuned file's (`skistune optimize`): how the config was found
        self.engine = engine
        self.relevant = relevant_knobs(config) & scope
        self.warnings: list[ExportWarning] = []
        self.notes: list[str] = []
        self._handled: set[str] = set()

    def value(self, knob: str) -> Any:
        return knob_value(self.config, knob)

    def express(self, *knobs: str) -> None:
        """These knobs are written (or, where off, left off) exactly."""
        self._handled.update(knobs)

    def instead(self, knob: str, written: str, reason: str, related: tuple[str, ...] = ()) -> None:
        """The knob cannot be expressed: ``written`` is the nearest setting the file holds instead."""
        related = tuple(k for k in related if k in self.relevant)
        self.warnings.append(ExportWarning(knob, self.value(knob), written, reason, related))
        self._handled.update((knob, *related))

    def fixed(self, knob: str, engine_value: Any, reason: str, written: str | None = None) -> None:
        """The engine has no setting for this knob and always behaves as ``engine_value``: expressed when
        the config asks for that, a warning otherwise. Knobs that do not matter here are skipped."""
        if knob not in self.relevant:
            return
        if self.value(knob) == engine_value:
            self.express(knob)
        else:
            self.instead(knob, written or show(engine_value), reason)

    def unaccounted(self) -> list[str]:
        """Relevant knobs the exporter neither expressed nor warned about (the contract tests want none)."""
        return sorted(self.relevant - self._handled)

    def account_unmapped(self) -> None:
        """The safety net for a knob added to `KVConfig` before an exporter maps it: at its default it is
        taken as the engine's default; otherwise it is reported, never dropped silently."""
        for knob in self.unaccounted():
            if is_default(self.config, knob):
                self.express(knob)
            else:
                self.instead(knob, "nothing (the engine's default)", f"the {self.engine} exporter has no mapping "
                             "for this knob yet")

    def expressed(self) -> tuple[str, ...]:
        warned = {k for w in self.warnings for k in w.knobs()}
        return tuple(sorted(self._handled & self.relevant - warned))


@dataclass(frozen=True)
class Rendered:
    """What an exporter's `render` returns: the file text, the command line (or None) and the companion
    files that command needs."""

    text: str
    command: str | None = None
    companions: tuple[Companion, ...] = ()


class Exporter(ABC):
    """One export target. Subclasses set the class attributes and implement `render`, which writes the
    file for one engine version and accounts for every relevant knob on the `Plan`."""

    name: ClassVar[str]
    engine: ClassVar[str]
    versions: ClassVar[tuple[EngineVersion, ...]]  # oldest first; the last is the default
    default_file: ClassVar[str]
    scope: ClassVar[frozenset[str]] = frozenset(knob_fields())

    @property
    def default_version(self) -> EngineVersion:
        return self.versions[-1]

    def version(self, name: str | None) -> EngineVersion:
        """The supported version called ``name`` (a leading ``v`` is ignored; ``newest`` is the default)."""
        if name is None or name in ("newest", "latest"):
            return self.default_version
        wanted = name[1:] if name[:1] in "vV" and name[1:2].isdigit() else name
        for v in self.versions:
            if v.name == wanted:
                return v
        known = ", ".join(v.name for v in self.versions)
        raise ValueError(f"--engine-version {name!r}: {self.engine} versions supported are {known} "
                         f"(default {self.default_version.name})")

    def export(self, config: KVConfig, version: EngineVersion, model: ModelSpec, file_name: str, *,
               provenance: Mapping[str, Any] | None = None) -> ExportResult:
        plan = Plan(config, f"{self.engine} {version.name}", self.scope, provenance)
        rendered = self.render(plan, version, model, file_name)
        plan.account_unmapped()
        outside = sorted(k for k in relevant_knobs(config) - self.scope if not is_default(config, k))
        return ExportResult(self.name, version.name, rendered.text, rendered.command, tuple(plan.warnings),
                            tuple(plan.notes), tuple(outside), plan.expressed(), companions=rendered.companions)

    @abstractmethod
    def render(self, plan: Plan, version: EngineVersion, model: ModelSpec, file_name: str) -> Rendered:
        """Write the target's file for ``plan.config``, calling ``plan.express``/``instead``/``fixed`` for
        every relevant knob."""
