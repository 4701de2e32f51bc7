"""The joint KV-cache settings: one frozen, validated config type that every layer reads.

`KVConfig` groups six knob families. Each knob is a dataclass field whose metadata holds its unit,
its allowed values (``choices``) or range (``low``/``high``) and a one-line help. Validation, the
YAML/JSON file format, the search space (``searchspace/``) and the exporters all read that metadata:
adding a knob means adding one field here.

    eviction      which tokens' KV is kept (policy, budget, sinks, recent window, per-layer schedule)
    bitwidth      how KV is represented (key/value bits, group size, full-precision window, per layer)
    offload       where KV lives (device/host/disk capacities, what moves down first, write policy)
    prefetch      bringing KV back up before it is needed
    batching      continuous batching (sequence and token caps, chunked prefill, policy, preemption)
    prefix_reuse  sharing KV of equal prompt prefixes (on/off, block size)

Invalid values raise ``ValueError`` naming the field, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping

import yaml


def knob(default: Any, help: str, *, unit: str = "", choices: tuple | None = None,
         low: float | None = None, high: float | None = None, nullable: bool = False) -> Any:
    """A config field with the metadata that validation, search spaces and exporters read."""
    meta = {"help": help, "unit": unit, "choices": choices, "low": low, "high": high, "nullable": nullable}
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


# byte sizes as people write them (config files, search spaces, --kv-memory): 8GiB, 500MB, 17179869184, and a
# plain number in scientific notation, 1e9: YAML reads 1e9 (no dot) as a string, not as the float 1.0e9 is.
# The exponent has at most 3 digits: Fraction("1e999999999") would build a billion-digit integer.
_BYTES = re.compile(r"^\s*(?:(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|PB|KiB|MiB|GiB|TiB|PiB)?|(\d+(?:\.\d+)?[eE][+-]?\d{1,3}))\s*$")
_BYTE_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
               "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50}


def parse_bytes(name: str, text: str) -> int:
    m = _BYTES.match(text)
    if not m:
        raise ValueError(f"{name}: {shown(text)} is not a byte size (write e.g. 16GiB, 500MB or 17179869184)")
    # exact: a float would turn 0.5B into 0 (a tier silently off) and 1.0001KiB into 1024; a size that
    # comes out fractional is refused, as a float byte count (1.5) is, while 1.5GiB and 0.3KB are whole
    try:
        size = Fraction(m.group(1) or m.group(3)) * _BYTE_UNITS[m.group(2)]
    except ValueError:  # (over 4,300 digits: Python's limit on converting text to integers)
        raise ValueError(f"{name}: {shown(text)} is not a byte size (a number of over 4,300 digits)") from None
    if size.denominator != 1:
        raise ValueError(f"{name}: {shown(text)} is not a whole number of bytes")
    return int(size)


def _byte_count(name: str, value: Any) -> Any:
    """A byte knob's value as an int where it is one: ``8GiB`` parsed, and a whole float (JSON's ``1e8``)
    converted like `parse_bytes` converts ``1.5GiB``; anything else is left for validation to reject."""
    if isinstance(value, str):
        return parse_bytes(name, value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def layer_bits_text(value: Any) -> Any:
    """Per-layer bits for a message, as runs: ``[4/4 x12, 8/8 x18]`` instead of thirty pairs; any other
    value as it is."""
    if not (isinstance(value, (list, tuple)) and value
            and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value)):
        return value
    runs: list[list] = []
    for pair in map(tuple, value):
        if runs and runs[-1][0] == pair:
            runs[-1][1] += 1
        else:
            runs.append([pair, 1])
    return "[" + ", ".join(f"{k}/{v} x{n}" for (k, v), n in runs) + "]"


def format_bytes(n: int | float) -> str:
    """A byte count for people: exact in the largest binary unit that divides it, as `parse_bytes` reads it
    back (``8GiB``, ``256MiB``), else to a tenth of the largest unit it reaches (``15.7 GiB``)."""
    units = [(u, b) for u, b in _BYTE_UNITS.items() if u and u.endswith("iB")][::-1]  # TiB first
    unit, size = next(((u, b) for u, b in units if n >= b), ("B", 1))
    return f"{int(n // size)}{unit}" if n % size == 0 else f"{n / size:.1f} {unit}"


def byte_size_text(knob: str, value: Any) -> str | None:
    """``8GiB`` for a non-zero integer of a knob measured in bytes (``offload.host_kv_bytes``), else None:
    how messages show such values instead of ``8589934592``."""
    f = knob_fields().get(knob)
    if f is None or f.metadata.get("unit") != "bytes" or not isinstance(value, int) or isinstance(value, bool):
        return None
    return format_bytes(value) if value else None


# what values of a knob's declared type (its annotation: ``int | None`` declares int) are, and their names
_KINDS: dict[str, tuple[type, str]] = {"bool": (bool, "a boolean (true/false)"), "int": (int, "an integer"),
                                       "float": (float, "a number"), "str": (str, "a string"),
                                       "tuple": (tuple, "a list")}


@functools.lru_cache(maxsize=None)  # (a search space of 100,000 choices asks it for each)
def declared_kind(f: dataclasses.Field) -> str:
    """The knob's type name without ``None`` ("int" for ``int | None``; annotations are strings here)."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    parts = [t.strip() for t in text.split("|") if t.strip() != "None"]
    return parts[0] if len(parts) == 1 else ""


def _is_kind(value: Any, kind: str) -> bool:
    if kind not in _KINDS:
        return True
    if isinstance(value, bool):  # an int to Python, but true is no block size
        return kind == "bool"
    if kind == "float":  # an int is a fine float (device_memory_fraction: 1)
        return isinstance(value, (int, float))
    return isinstance(value, _KINDS[kind][0])


def _check_value(owner: str, f: dataclasses.Field, value: Any) -> None:
    name = f"{owner}.{f.name}"
    meta = f.metadata
    if value is None:
        if not meta.get("nullable"):
            raise ValueError(f"{name}: null is not allowed")
        return
    kind, choices = declared_kind(f), meta.get("choices")
    if kind == "bool" and not _is_kind(value, kind):
        raise ValueError(f"{name}: {shown(value)} is not a boolean (true/false)")
    if choices is not None:
        allowed = ", ".join(str(c) for c in choices)
        if not _is_kind(value, kind):  # type-strict: 4.0 == 4 would pass `in` alone, then break integer code
            raise ValueError(f"{name}: {shown(value)} is not {_KINDS[kind][1]} (one of {allowed})")
        if value not in choices:
            raise ValueError(f"{name}: {shown(value)} is not one of {allowed}")
        return
    if kind in ("int", "float") and not _is_kind(value, "float"):
        raise ValueError(f"{name}: {shown(value)} is not a number{_number_text_hint(value)}")
    if not _is_kind(value, kind):  # 10.5 tokens, 1e8 bytes (a whole float byte count is converted in from_dict)
        raise ValueError(f"{name}: {shown(value)} is not {_KINDS[kind][1]}")
    low, high = meta.get("low"), meta.get("high")
    # "not inside" rather than "outside": every comparison with NaN is False, so NaN is outside too
    if not ((low is None or value >= low) and (high is None or value <= high)):
        raise ValueError(f"{name}: {shown(value)} is outside [{low}, {high}]{' ' + meta['unit'] if meta['unit'] else ''}")


def _number_text_hint(value: Any) -> str:
    """For text that reads as a number: YAML (1.1, as PyYAML reads it) takes ``1e3`` as a string, since its
    floats need a dot (``1.0e+3``); say so, and what to write."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    plain = int(number) if number.is_integer() else number
    return f" (YAML reads {shown_name(value)} as text: write {shown_name(plain)})"


class _Family:
    """Shared behaviour of the knob families: field-wise validation and dict conversion."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            _check_value(self.section, f, getattr(self, f.name))
        self._check_joint()

    section = ""

    def _check_joint(self) -> None:
        """Constraints between fields of one family (overridden where there are any)."""

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "_Family":
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.section}: expected a mapping of knobs, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names, key=str)
        if unknown:
            raise ValueError(f"{cls.section}.{shown_name(unknown[0])}: unknown knob (known: {', '.join(sorted(names))})")
        kwargs = {k: (_to_tuple(v) if isinstance(v, list) else v) for k, v in data.items()}
        for f in fields(cls):  # type: ignore[arg-type]
            if f.metadata.get("unit") == "bytes" and f.name in kwargs:  # host_kv_bytes: 8GiB
                kwargs[f.name] = _byte_count(f"{cls.section}.{f.name}", kwargs[f.name])
        return cls(**kwargs)


class _KnobDumper(yaml.SafeDumper):
    """Block style for families, flow style for short lists of scalars (``layer_bits: [[4, 4], ...]``
    stays one line per layer pair instead of three)."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flow = all(not isinstance(x, (list, dict)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_KnobDumper.add_representer(list, _represent_list)


# Bounds on what a YAML file may build (`load_yaml`): no config or search space nests past a few levels, and
# 5,000 nested lists had run the parser out of Python's recursion limit (a traceback); nine anchors of nine
# aliases each (a "billion laughs") compose to a few hundred nodes but expand to 9^9 values wherever a knob reads
# one, and grew a process past a gigabyte. Aliases may add this many nodes to the file's own, all told.
MAX_YAML_DEPTH = 100
MAX_ALIAS_NODES = 100_000


class _Bounded:
    """The composing half of `load_yaml`'s loaders: collections nested deeper than `MAX_YAML_DEPTH`, aliases that
    expand to more than `MAX_ALIAS_NODES` nodes in all, and an alias inside the node it names (a value that
    contains itself) are errors."""

    def _start_bounds(self) -> None:
        self._depth = 0
        self._alias_nodes = 0
        self._expanded: dict[int, int] = {}  # id of a composed node -> the nodes it stands for, aliases expanded

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):  # type: ignore[attr-defined]
            mark = self.peek_event().start_mark  # type: ignore[attr-defined]
            node = super().compose_node(parent, index)  # type: ignore[misc] (the anchored node, or "undefined alias")
            size = self._expanded.get(id(node))
            if size is None:  # its anchor's node is still being composed: `a: &a [*a]`
                raise yaml.composer.ComposerError(None, None, "an alias inside the node it names: a value that "
                                                  "contains itself", mark)
            self._alias_nodes += size
            if self._alias_nodes > MAX_ALIAS_NODES:
                raise yaml.composer.ComposerError(None, None, f"aliases expand to more than {MAX_ALIAS_NODES:,} "
                                                  "values", mark)
            return node
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_YAML_DEPTH} levels",
                                              self.peek_event().start_mark)  # type: ignore[attr-defined]
        self._depth += 1
        try:
            node = super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1
        expanded = self._expanded
        if isinstance(node, yaml.SequenceNode):
            expanded[id(node)] = 1 + sum([expanded[id(item)] for item in node.value])
        elif isinstance(node, yaml.MappingNode):
            expanded[id(node)] = 1 + sum([expanded[id(key)] + expanded[id(value)] for key, value in node.value])
        else:
            expanded[id(node)] = 1
        return node


class _UniqueKeyLoader(_Bounded, yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last, so a second
    ``batching:`` block had silently replaced the first, knobs and all), and what `_Bounded` refuses."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._start_bounds()


try:
    from yaml.cyaml import CParser
except ImportError:  # (a PyYAML built without libyaml)
    _FastUniqueKeyLoader = None
else:
    class _FastUniqueKeyLoader(_Bounded, yaml.composer.Composer, CParser, yaml.constructor.SafeConstructor,
                               yaml.resolver.Resolver):
        """`_UniqueKeyLoader` reading libyaml's events (about 3x as fast: 100,000 choices took 2.4 s to parse in
        Python), composed by PyYAML's own composer, so that the same bounds hold."""

        def __init__(self, stream: Any) -> None:
            CParser.__init__(self, stream)
            yaml.composer.Composer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            self._start_bounds()


def _bounded_int(loader: Any, node: yaml.ScalarNode) -> int:
    """An integer as YAML reads it; one of over 4,300 digits is an error of the file (Python's own error told to
    call ``sys.set_int_max_str_digits``)."""
    try:
        return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)
    except ValueError:
        raise yaml.constructor.ConstructorError(None, None, "a number of over 4,300 digits",
                                                node.start_mark) from None


def _unique_mapping(loader: Any, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys are merged below, and may be overridden
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shown(key)} (first at line {first[key]})",
                    key_node.start_mark)
            first[key] = line
        except TypeError:  # an unhashable key: the constructor below says so
            pass
    return loader.construct_mapping(node, deep=deep)


for _loader in (_UniqueKeyLoader, _FastUniqueKeyLoader):
    if _loader is not None:
        _loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
        _loader.add_constructor("tag:yaml.org,2002:int", _bounded_int)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line and column, counted from 1)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{getattr(exc, 'problem', None) or str(exc).splitlines()[0]}{where}"


def load_yaml(text: str) -> Any:
    """YAML as `yaml.safe_load` reads it, except that a key given twice in one mapping, nesting deeper than
    `MAX_YAML_DEPTH` and aliases expanding past `MAX_ALIAS_NODES` are errors (`yaml.YAMLError`): config and
    search-space files read it."""
    if _FastUniqueKeyLoader is not None:
        try:
            return yaml.load(text, Loader=_FastUniqueKeyLoader)  # noqa: S506 (a safe loader)
        except (yaml.YAMLError, UnicodeError):
            pass  # read again in Python: its errors say what is wrong and where as they always have
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def load_json(text: str) -> Any:
    """JSON as `json.loads` reads it, except that nesting deeper than `MAX_YAML_DEPTH` is an error (`ValueError`,
    as for YAML: a deep enough file had raised ``RecursionError`` in the parser or after it), and so is a number of
    over 4,300 digits in words that say so."""
    try:
        data = json.loads(text)
        too_deep = nesting_depth(data) > MAX_YAML_DEPTH
    except RecursionError:
        too_deep = True
    except json.JSONDecodeError:
        raise
    except ValueError:  # (Python's limit on integer digits, whose message told to call sys.set_int_max_str_digits)
        raise ValueError("a number of over 4,300 digits") from None
    if too_deep:
        raise ValueError(f"nested more than {MAX_YAML_DEPTH} levels")
    return data


def nesting_depth(data: Any) -> int:
    """How many lists and mappings deep ``data`` nests (0 for a scalar), without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            children = list(value.values())
        elif isinstance(value, (list, tuple)):
            children = list(value)
        else:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_YAML_DEPTH:  # (deeper than that is refused: no need to walk on)
            stack.extend((child, depth + 1) for child in children)
    return deepest


SHOWN_CHARS = 80


def did_you_mean(value: Any, known: Any) -> str:
    """`` (did you mean X?)`` where ``value`` is a near miss of one of ``known`` (a misspelt choice: ``capacty``,
    ``defualt``, ``simulte``), else ``""``: the errors list every choice, and the near one is the likely intent."""
    import difflib

    names = [str(k) for k in known]
    close = difflib.get_close_matches(str(value).strip().lower(), names, n=1, cutoff=0.6) or \
        difflib.get_close_matches(str(value).strip(), names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close and close[0] != str(value) else ""


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with how long the value is after an
    ellipsis (``'xxxx…(1,048,576 characters)``, ``(4, 4, 4, …(1,000 items)``): a message echoed a 1 MB string
    or a thousand-entry list whole. Strings that are names (keys) go through it as well."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, (str, bytes)):
        size = f"{len(value):,} characters"
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        size = f"{len(value):,} items"
    else:
        size = f"{len(text):,} characters"
    return f"{text[:limit]}…({size})"


def shown_name(name: Any, limit: int = SHOWN_CHARS) -> str:
    """A name from a file (a key, a dotted knob) as a message shows it: as it is, or cut as `shown` cuts."""
    text = str(name)
    return text if len(text) <= limit else f"{text[:limit]}…({len(text):,} characters)"


def _to_tuple(v: list) -> tuple:
    return tuple(_to_tuple(x) if isinstance(x, list) else x for x in v)


EVICTION_POLICIES = ("none", "streaming", "h2o", "snapkv", "tova")
KV_BITS = (16, 8, 4, 2)
SCHEDULING_POLICIES = ("fcfs", "prefix", "edf")


@dataclass(frozen=True)
class EvictionConfig(_Family):
    """Which tokens' KV stays in the cache.

    The budget is either a token count (``budget_tokens``) or a fraction of each sequence's context
    (``budget_fraction``); exactly one is set when the policy is not ``none``, neither when it is.
    """

    section = "eviction"
    policy: str = knob("none", "eviction policy", choices=EVICTION_POLICIES)
    budget_tokens: int | None = knob(None, "KV tokens kept per sequence and KV head", unit="tokens",
                                     low=1, high=1 << 20, nullable=True)
    budget_fraction: float | None = knob(None, "fraction of the context kept", low=0.01, high=1.0, nullable=True)
    sink_tokens: int = knob(4, "first tokens always kept (attention sinks)", unit="tokens", low=0, high=1024)
    recent_window: int = knob(64, "most recent tokens always kept", unit="tokens", low=0, high=1 << 20)
    layer_schedule: str = knob("uniform", "budget across layers", choices=("uniform", "pyramid"))

    def _check_joint(self) -> None:
        has_budget = (self.budget_tokens is not None) + (self.budget_fraction is not None)
        if self.policy == "none" and has_budget:
            raise ValueError("eviction.budget_*: a budget needs a policy other than 'none'")
        if self.policy != "none" and has_budget != 1:
            raise ValueError(f"eviction.budget_*: policy {self.policy!r} needs exactly one of "
                             "budget_tokens or budget_fraction")


@dataclass(frozen=True)
class BitwidthConfig(_Family):
    """How KV is represented: asymmetric integer quantization with per-group scales and zero points,
    keys grouped per channel and values per token (KIVI), the newest ``full_precision_window`` tokens
    kept at 16 bits. ``layer_bits`` optionally overrides the bits per layer as ``[[key, value], ...]``.
    """

    section = "bitwidth"
    key_bits: int = knob(16, "bits per key element", unit="bits", choices=KV_BITS)
    value_bits: int = knob(16, "bits per value element", unit="bits", choices=KV_BITS)
    group_size: int = knob(32, "elements sharing one scale and zero point", unit="elements",
                           choices=(16, 32, 64, 128))
    full_precision_window: int = knob(0, "newest tokens kept at 16 bits", unit="tokens", low=0, high=4096)
    layer_bits: tuple | None = knob(None, "per-layer [key_bits, value_bits] overrides", nullable=True)

    def _check_joint(self) -> None:
        if self.layer_bits is None:
            return
        if len(self.layer_bits) == 0:
            raise ValueError("bitwidth.layer_bits: empty list (use null for no per-layer override)")
        for i, pair in enumerate(self.layer_bits):
            # type-strict: 4.0 == 4, but float bits break the quantizer
            valid = isinstance(pair, tuple) and len(pair) == 2 and all(_is_kind(b, "int") and b in KV_BITS
                                                                       for b in pair)
            if not valid:
                raise ValueError(f"bitwidth.layer_bits[{i}]: {shown(list(pair) if isinstance(pair, tuple) else pair)} is not a [key_bits, value_bits] pair "
                                 f"of {KV_BITS}")

    def bits_for_layer(self, layer: int) -> tuple[int, int]:
        if self.layer_bits is None:
            return self.key_bits, self.value_bits
        return self.layer_bits[layer]


@dataclass(frozen=True)
class OffloadConfig(_Family):
    """Where KV lives. The device pool is ``device_kv_bytes`` when set, else ``device_memory_fraction``
    of the device memory left after the weights. Host and disk pools of 0 bytes are off."""

    section = "offload"
    device_memory_fraction: float = knob(0.9, "fraction of free device memory for KV", low=0.01, high=1.0)
    device_kv_bytes: int | None = knob(None, "device KV pool size (overrides the fraction)", unit="bytes",
                                       low=1, high=1 << 50, nullable=True)
    host_kv_bytes: int = knob(0, "host-memory KV pool", unit="bytes", low=0, high=1 << 50)
    disk_kv_bytes: int = knob(0, "disk KV pool", unit="bytes", low=0, high=1 << 50)
    demote_first: str = knob("cached_prefix", "what moves down a tier first when the device is full",
                             choices=("cached_prefix", "preempted"))
    write_policy: str = knob("write_back", "blocks copied down only when evicted (write_back) or as soon as "
                             "they are full (write_through)", choices=("write_back", "write_through"))


@dataclass(frozen=True)
class PrefetchConfig(_Family):
    """Bringing offloaded KV back before it is needed, overlapped with compute. ``unit: blocks``: the
    lower-tier prefix blocks of waiting sequences are promoted ahead of their admission, ``depth`` blocks
    per step, while steps compute. ``unit: layers``: a step's own host <-> device copies run layer by layer
    beside its forward pass, ``depth`` layers ahead of the compute at most (LMCache's layer-wise loading,
    SGLang's HiCache). See docs/tiers.md."""

    section = "prefetch"
    enabled: bool = knob(False, "prefetch offloaded KV ahead of use", choices=(False, True))
    depth: int = knob(2, "how far ahead transfers start (blocks per step, or layers)", low=1, high=64)
    unit: str = knob("blocks", "blocks: promote waiting sequences' blocks ahead of admission; layers: load "
                     "each step's blocks layer by layer beside its forward pass", choices=("layers", "blocks"))


@dataclass(frozen=True)
class BatchingConfig(_Family):
    """Continuous batching under one token budget per step (prefill and decode tokens alike)."""

    section = "batching"
    max_num_seqs: int = knob(256, "running sequences per step", unit="sequences", low=1, high=65536)
    max_num_batched_tokens: int = knob(2048, "tokens computed per step", unit="tokens", low=1, high=1 << 20)
    chunked_prefill: bool = knob(True, "split long prompts over several steps", choices=(False, True))
    chunk_size: int = knob(512, "largest prefill chunk of one sequence per step", unit="tokens",
                           low=1, high=1 << 20)
    policy: str = knob("fcfs", "admission order: arrival, longest cached prefix, earliest deadline",
                       choices=SCHEDULING_POLICIES)
    preemption: str = knob("recompute", "what a preempted sequence loses", choices=("recompute", "swap"))


@dataclass(frozen=True)
class PrefixReuseConfig(_Family):
    """Paged KV in fixed-size blocks; full blocks of equal prompt prefixes are shared."""

    section = "prefix_reuse"
    enabled: bool = knob(True, "share KV blocks of equal prefixes", choices=(False, True))
    block_size: int = knob(16, "tokens per KV block", unit="tokens", choices=(1, 2, 4, 8, 16, 32, 64, 128, 256))


PROVENANCE_KEY = "provenance"

FAMILIES: dict[str, type[_Family]] = {
    "eviction": EvictionConfig,
    "bitwidth": BitwidthConfig,
    "offload": OffloadConfig,
    "prefetch": PrefetchConfig,
    "batching": BatchingConfig,
    "prefix_reuse": PrefixReuseConfig,
}


@dataclass(frozen=True)
class KVConfig:
    """All KV-cache knobs of one serving deployment (see the module docstring for the families)."""

    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    bitwidth: BitwidthConfig = field(default_factory=BitwidthConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    prefix_reuse: PrefixReuseConfig = field(default_factory=PrefixReuseConfig)

    def __post_init__(self) -> None:
        for f in fields(self):
            family = getattr(self, f.name)
            # KVConfig(batching={"max_num_seqs": 4}): a mapping is read as a file's family is (validated,
            # defaults for the rest); anything else but the family's type had failed later, far from here
            if isinstance(family, Mapping):
                object.__setattr__(self, f.name, FAMILIES[f.name].from_dict(family))
            elif not isinstance(family, FAMILIES[f.name]):
                raise TypeError(f"{f.name}: expected a {FAMILIES[f.name].__name__} or a mapping of knobs, "
                                f"got {type(family).__name__}")
        b = self.batching
        # without chunked prefill the chunk size is never used (the scheduler computes a whole prompt, the
        # exporters drop the knob): the default 512 had refused max_num_batched_tokens: 64 with chunking off
        if b.chunked_prefill and b.chunk_size > b.max_num_batched_tokens:
            if b.chunk_size == _default("batching", "chunk_size"):  # likely never set: say which knob to set
                raise ValueError(f"batching.chunk_size: {b.chunk_size} (the default) exceeds "
                                 f"batching.max_num_batched_tokens ({b.max_num_batched_tokens}); set "
                                 f"batching.chunk_size to at most {b.max_num_batched_tokens}")
            raise ValueError(f"batching.chunk_size: {b.chunk_size} exceeds "
                             f"batching.max_num_batched_tokens ({b.max_num_batched_tokens})")

    # ---- conversion -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: getattr(self, name).to_dict() for name in FAMILIES}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVConfig":
        """Knob families by name; a top-level ``provenance`` mapping (written by `skistune optimize`: how the
        config was found) is metadata and ignored here."""
        if not isinstance(data, Mapping):
            raise ValueError(f"config: expected a mapping of knob families, got {type(data).__name__}")
        unknown = sorted(set(data) - set(FAMILIES) - {PROVENANCE_KEY}, key=str)
        if unknown:
            raise ValueError(f"{shown_name(unknown[0])}: unknown knob family (known: {', '.join(FAMILIES)})")
        return cls(**{name: FAMILIES[name].from_dict(data[name] or {}) for name in data if name in FAMILIES})

    def to_yaml(self, provenance: Mapping[str, Any] | None = None) -> str:
        """The config as YAML; ``provenance`` (how it was found) goes last, under its own key."""
        data: dict[str, Any] = self.to_dict()
        if provenance is not None:
            data[PROVENANCE_KEY] = dict(provenance)
        return yaml.dump(data, Dumper=_KnobDumper, sort_keys=False, default_flow_style=False)

    @classmethod
    def from_yaml(cls, text: str) -> "KVConfig":
        try:
            data = load_yaml(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"config: not valid YAML ({yaml_problem(exc)})") from None
        return cls.from_dict(data or {})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "KVConfig":
        try:
            data = load_json(text)
        except ValueError as exc:  # (malformed, or nested too deep)
            raise ValueError(f"config: not valid JSON ({exc})") from None
        return cls.from_dict(data)

    def effective(self) -> "KVConfig":
        """This config with the knobs that do nothing in it at their defaults: a prefetch depth and unit with
        prefetch off, what moves down and how it is written without a host or disk tier, the details of an
        eviction policy of ``none``, quantization groups and windows with every layer at 16 bits, the uniform
        key and value bits where per-layer bits override them (and per-layer bits that are one pair on every
        layer written as the uniform bits they are). Two configs that serve alike compare equal (a search space that fixes ``prefetch.depth`` does not make a config
        differ from vLLM's defaults)."""
        inert: list[str] = []
        pairs = {tuple(pair) for pair in self.bitwidth.layer_bits or ()}
        if len(pairs) == 1:  # the same bits on every layer: the uniform bits they are
            (key_bits, value_bits), = pairs
            return self.with_knobs({"bitwidth.key_bits": key_bits, "bitwidth.value_bits": value_bits,
                                    "bitwidth.layer_bits": None}).effective()
        if pairs:  # per-layer bits override the uniform ones on every layer
            inert += ["bitwidth.key_bits", "bitwidth.value_bits"]
        if not self.prefetch.enabled:
            inert += ["prefetch.depth", "prefetch.unit"]
        if not self.offload.host_kv_bytes and not self.offload.disk_kv_bytes:
            inert += ["offload.demote_first", "offload.write_policy"]
        if self.eviction.policy == "none":
            inert += [f"eviction.{f.name}" for f in fields(EvictionConfig) if f.name != "policy"]
        b = self.bitwidth
        if b.key_bits == b.value_bits == 16 and not b.layer_bits:
            inert += ["bitwidth.group_size", "bitwidth.full_precision_window"]
        defaults = KVConfig()
        return self.with_knobs({k: getattr(getattr(defaults, k.partition(".")[0]), k.partition(".")[2])
                                for k in inert})

    def with_knobs(self, updates: Mapping[str, Any]) -> "KVConfig":
        """A copy with dotted knobs replaced, e.g. ``{"eviction.policy": "h2o"}``."""
        by_family: dict[str, dict[str, Any]] = {}
        for dotted, value in updates.items():
            family, _, name = dotted.partition(".")
            if family not in FAMILIES or not name:
                raise ValueError(f"{shown_name(dotted)}: not a knob (write family.knob, families: {', '.join(FAMILIES)})")
            by_family.setdefault(family, {})[name] = value
        data = self.to_dict()
        for family, values in by_family.items():
            data[family].update(values)
        return KVConfig.from_dict(data)


def _default(family: str, name: str) -> Any:
    return next(f.default for f in fields(FAMILIES[family]) if f.name == name)


def knob_fields() -> dict[str, dataclasses.Field]:
    """Every knob by dotted name (``family.knob``), with the metadata search spaces validate against."""
    return {f"{fam}.{f.name}": f for fam, cls in FAMILIES.items() for f in fields(cls)}


def load_provenance(path: str | os.PathLike) -> Mapping[str, Any]:
    """The provenance `skistune optimize` writes into a tuned file, or {} (a config written by hand, or
    unreadable: `load_config` reads and checks its knobs)."""
    try:
        provenance = load_yaml(Path(path).read_text(encoding="utf-8"))["provenance"]
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return {}
    return provenance if isinstance(provenance, Mapping) else {}


def load_config(path: str | os.PathLike) -> KVConfig:
    """Read a config file (.yaml/.yml or .json), raising ``ValueError`` that names the file."""
    path = os.fspath(path)  # (a Path had failed on `.endswith`)
    try:
        with open(path, encoding="utf-8-sig") as fh:  # (a byte-order mark, as some editors write, is dropped)
            text = fh.read()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read config ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a config (not UTF-8 text; binary or corrupted?)") from None
    try:
        return KVConfig.from_json(text) if path.endswith(".json") else KVConfig.from_yaml(text)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
