"""Declarative search spaces: which knobs the optimizer varies, over which values, under which conditions.

A space is a YAML file; the shipped ones live in the repository's ``searchspace/`` folder (installed as
the package data ``skistune.searchspaces``) and the format is documented at the top of
``searchspace/default.yaml``. Knob names are ``KVConfig``'s dotted field names and every range or
choice is checked against that knob's own metadata at load time. The config's joint rules are kept by
the space's structure, so every sampled point is a valid ``KVConfig``:

    when:     a knob exists only where it means something (an eviction budget only with a policy)
    when_any: ... where one of several conditions holds (a quantization group where keys or values are quantized)
    at_most:  a range bounded by another knob (chunk_size <= max_num_batched_tokens)
    same_as:  a knob tied to another (one KV dtype for keys and values in vLLM and SGLang)
    solver:   a knob filled by a program (bits per layer from the integer program), not sampled

    load_space(name_or_path) -> SearchSpace
    suggest_config(trial, space, base, solvers) -> KVConfig    one Optuna trial's config
    grid(space, points_per_range) -> list[KVConfig]            a finite grid for exhaustive benchmarks
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import yaml

from skistune.config import (FAMILIES, KVConfig, _check_value, did_you_mean, declared_kind, knob_fields, load_yaml, parse_bytes,
                             shown, shown_name, yaml_problem)

Solver = Callable[[KVConfig], Any]  # given the config built so far, returns the knob's value

SHIPPED_PACKAGE = "skistune.searchspaces"
_REPO_SPACES = Path(__file__).resolve().parent.parent / "searchspace"
_TOP_KEYS = ("name", "description", "switches", "knobs", "fixed")
_RANGE_KEYS = ("type", "low", "high", "log", "step", "at_most")
_SPEC_KEYS = ("choices", "solver", "same_as", "when", "when_any") + _RANGE_KEYS
_SCALARS = (bool, int, float, str, type(None))  # what Optuna can store as a categorical choice
MAX_SWITCH_NAME = 64  # characters of a switch's name (every message about the switch repeats it)


@dataclass(frozen=True)
class Param:
    """One searched variable: a knob (dotted name) or a switch (plain name; it only steers conditions)."""

    name: str
    kind: str  # "choices", "int", "float", "same_as" or "solver"
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    when: tuple[tuple[str, tuple], ...] = ()  # all must hold: (knob or switch, allowed values)
    when_any: tuple[tuple[str, tuple], ...] = ()  # ... and at least one of these, where given
    at_most: str | None = None
    same_as: str | None = None
    solver: str | None = None
    nullable: bool = False  # an inactive nullable knob is null ("exists only when ...")

    @property
    def is_switch(self) -> bool:
        return "." not in self.name


@dataclass(frozen=True)
class SearchSpace:
    """A validated search space. ``params`` are in decision order: whatever a condition, bound or tie
    reads is decided before the knob that reads it."""

    name: str
    description: str
    params: tuple[Param, ...]
    fixed: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    source: str = ""

    def knob_names(self) -> tuple[str, ...]:
        """Knobs the space varies (sampled, tied or solved), as dotted names."""
        return tuple(p.name for p in self.params if not p.is_switch)

    def switch_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.is_switch)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{name}: not in search space {self.name!r} (it has {', '.join(p.name for p in self.params)})")


# ---- loading ----------------------------------------------------------------------------------------
def _shipped_root():
    """The installed package data; an editable install made before the package-data entry existed
    (no such package, or an empty namespace) reads the repository folder instead."""
    try:
        root = importlib.resources.files(SHIPPED_PACKAGE)
    except ModuleNotFoundError:
        return _REPO_SPACES
    return root if root.joinpath("default.yaml").is_file() else _REPO_SPACES


def shipped_spaces() -> tuple[str, ...]:
    """Names of the spaces that ship with skistune (``load_space`` accepts them bare)."""
    return tuple(sorted(p.name[:-5] for p in _shipped_root().iterdir() if p.name.endswith(".yaml")))


def load_space(space: str | os.PathLike | SearchSpace) -> SearchSpace:
    """A shipped space by bare name (``default``, ``vllm``), or a user file by path (``.yaml``/``.yml``,
    or anything with a path separator). Raises ``ValueError`` naming the file, the knob and the reason."""
    if isinstance(space, SearchSpace):
        return space
    text, source = _read_space(os.fspath(space))
    return parse_space(text, source=source)


def _read_space(spec: str) -> tuple[str, str]:
    if not (spec.endswith((".yaml", ".yml")) or "/" in spec or os.sep in spec):
        names = shipped_spaces()
        if spec not in names:
            raise ValueError(f"{spec}{did_you_mean(spec, names)}: no shipped search space of that name (shipped: "
                             f"{', '.join(names)}); "
                             "pass a path to a .yaml file for your own")
        return _shipped_root().joinpath(f"{spec}.yaml").read_text(encoding="utf-8"), f"{spec}.yaml"
    try:
        return Path(spec).read_text(encoding="utf-8"), spec
    except OSError as exc:
        raise ValueError(f"{spec}: cannot read search space ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{spec}: not a search space (not UTF-8 text; binary or corrupted?)") from None


def parse_space(text: str, source: str = "<string>") -> SearchSpace:
    """Parse and validate a space from YAML text; ``source`` names it in errors."""
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML ({yaml_problem(exc)})") from None
    try:
        return _build_space(data, source)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _build_space(data: Any, source: str) -> SearchSpace:
    if not isinstance(data, dict):
        raise ValueError("expected a mapping with name, description, knobs (and optionally switches, fixed)")
    unknown = sorted(set(map(str, data)) - set(_TOP_KEYS))
    if unknown:
        raise ValueError(f"{shown_name(unknown[0])}: unknown section (sections: {', '.join(_TOP_KEYS)})")
    knobs = data.get("knobs")
    if not isinstance(knobs, dict) or not knobs:
        raise ValueError("knobs: missing or empty; list at least one knob to search")
    fields_ = knob_fields()
    fixed = _parse_fixed(data.get("fixed") or {}, fields_)
    switches = data.get("switches") or {}
    if not isinstance(switches, dict):
        raise ValueError("switches: expected a mapping of name -> {choices: [...]}")
    params = [_parse_switch(str(n), s) for n, s in switches.items()]
    params += [_parse_knob(str(n), s, fields_) for n, s in knobs.items()]
    params = _check_refs(params, fixed, fields_)
    name = data.get("name", Path(source).stem)
    return SearchSpace(name=str(name), description=str(data.get("description", "")),
                       params=_decision_order(params), fixed=MappingProxyType(fixed), source=source)


# ---- values against the knob's own metadata ---------------------------------------------------------
def _field_type(f: dataclasses.Field) -> str:
    """"bool", "int", "float", "str", or "other" (structured values such as layer_bits)."""
    kind = declared_kind(f)
    return kind if kind in ("bool", "int", "float", "str") else "other"


def _is_type(value: Any, kind: str) -> bool:
    if kind == "float":
        return isinstance(value, float)
    return isinstance(value, {"bool": bool, "int": int, "str": str}[kind]) and (
        kind == "bool" or not isinstance(value, bool))


def _unknown_knob(name: str, fields_: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(fields_), n=1)
    hint = f"did you mean {close[0]}?" if close else "knobs are family.field, see skistune.config.knob_fields()"
    return f"{shown_name(name)}: unknown knob ({hint})"


def _field_value(name: str, f: dataclasses.Field, raw: Any, role: str = "") -> Any:
    """``raw`` as a valid value of knob ``name`` (byte sizes parsed, ints widened for float knobs)."""
    kind, value = _field_type(f), raw
    if isinstance(raw, str) and f.metadata.get("unit") == "bytes":
        value = parse_bytes(name, raw)
    if kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if value is not None and kind != "other" and not _is_type(value, kind):
        raise ValueError(f"{name}: {role}{shown(raw)} is not {'an' if kind == 'int' else 'a'} {kind}")
    try:
        _check_value(name.partition(".")[0], f, value)
    except ValueError as exc:
        raise ValueError(f"{name}: {role}{str(exc).partition(': ')[2]}") from None
    return value


def _structured_value(name: str, raw: Any) -> Any:
    """A non-scalar knob (layer_bits) validated by its own family, which also turns lists into tuples."""
    family, _, knob = name.partition(".")
    try:
        return getattr(FAMILIES[family].from_dict({knob: raw}), knob)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {shown(raw)} is not a valid value ({exc})") from None


def _same(a: Any, b: Any) -> bool:
    """Equality that keeps true apart from 1 (YAML and Python both let them compare equal)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _same_key(value: Any) -> tuple[bool, Any]:
    """``value`` as a set member under `_same`: equal keys for 1 and 1.0, apart ones for true and 1. A set of
    them finds a value among 100,000 choices at once, where comparing with each one had taken minutes."""
    return isinstance(value, bool), value


def _same_keys(values: Any) -> set:
    """The `_same_key` of each (hashable) value; NaN, equal to nothing under `_same`, is left out."""
    return {_same_key(v) for v in values if v == v}


def _among(value: Any, keys: set) -> bool:
    """Whether ``value`` is `_same` as a value of ``keys`` (`_same_keys`); an unhashable one is not."""
    try:
        return value == value and _same_key(value) in keys
    except TypeError:  # (a list where a scalar was expected)
        return False


def _listed(values: Any) -> str:
    """Values for a message, comma-separated, cut as `shown` cuts a long one."""
    return shown_name(", ".join(map(str, values)))


# ---- sections ---------------------------------------------------------------------------------------
def _parse_fixed(raw: Any, fields_: Mapping[str, dataclasses.Field]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError("fixed: expected a mapping of knob -> value")
    out = {}
    for name, value in raw.items():
        f = fields_.get(name)
        if f is None:
            raise ValueError(f"fixed: {_unknown_knob(name, fields_)}")
        out[name] = _structured_value(name, value) if _field_type(f) == "other" else _field_value(name, f, value)
    return out


def _parse_when(name: str, raw: Any, key: str = "when") -> tuple[tuple[str, tuple], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{name}: {key}: expected a mapping of knob -> allowed values, "
                         "e.g. {eviction.policy: [h2o, snapkv]}")
    out = []
    for ref, values in raw.items():
        values = values if isinstance(values, list) else [values]
        if not values:
            raise ValueError(f"{name}: {key} {shown_name(ref)}: empty list of values (the knob could never be active)")
        out.append((str(ref), tuple(values)))
    return tuple(out)


def _conditions(name: str, spec: Mapping[str, Any]) -> dict[str, tuple]:
    """A knob's or switch's ``when`` and ``when_any``, parsed, as `Param` keywords."""
    return {key: _parse_when(name, spec.get(key), key) for key in ("when", "when_any")}


def _parse_choices(name: str, raw: Any, f: dataclasses.Field | None) -> tuple:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{name}: choices: expected a non-empty list")
    values: list = []
    seen: set = set()
    for item in raw:
        value = _field_value(name, f, item, "choice ") if f is not None else item
        if not isinstance(value, _SCALARS):
            raise ValueError(f"{name}: choice {shown(item)} is not a scalar (null, bool, number or string)")
        if _among(value, seen):
            raise ValueError(f"{name}: choice {shown(item)} is listed twice")
        seen |= _same_keys((value,))
        values.append(value)
    return tuple(values)


def _parse_switch(name: str, spec: Any) -> Param:
    if not name.isidentifier() or len(name) > MAX_SWITCH_NAME:
        raise ValueError(f"switches: {shown_name(name)}: a switch name is a plain identifier without dots, of at "
                         f"most {MAX_SWITCH_NAME} characters (dotted names are knobs; list those under knobs)")
    if not isinstance(spec, dict) or "choices" not in spec or set(spec) - {"choices", "when", "when_any"}:
        raise ValueError(f"switches: {name}: expected {{choices: [...]}} (optionally with when: or when_any:)")
    return Param(name, "choices", choices=_parse_choices(name, spec["choices"], None), **_conditions(name, spec))


def _parse_knob(name: str, spec: Any, fields_: Mapping[str, dataclasses.Field]) -> Param:
    f = fields_.get(name)
    if f is None:
        raise ValueError(f"knobs: {_unknown_knob(name, fields_)}")
    if not isinstance(spec, dict):
        raise ValueError(f"{name}: expected a mapping such as {{choices: [...]}} or {{low: 1, high: 8}}, got {shown(spec)}")
    unknown = sorted(set(map(str, spec)) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"{name}: unknown key {shown(unknown[0])} (keys: {', '.join(_SPEC_KEYS)})")
    kinds = [k for k in ("choices", "solver", "same_as") if k in spec] + (
        ["range"] if "low" in spec or "high" in spec else [])
    if len(kinds) != 1:
        raise ValueError(f"{name}: give exactly one of choices, low/high, solver or same_as "
                         f"(got {', '.join(kinds) or 'none'})")
    if kinds[0] != "range" and set(spec) & set(_RANGE_KEYS):
        raise ValueError(f"{name}: {min(set(spec) & set(_RANGE_KEYS))} applies only to low/high ranges")
    if kinds[0] != "solver" and _field_type(f) == "other":
        raise ValueError(f"{name}: a structured knob; fill it with solver: or set it under fixed:")
    when, nullable = _conditions(name, spec), bool(f.metadata.get("nullable"))
    if kinds[0] == "choices":
        return Param(name, "choices", choices=_parse_choices(name, spec["choices"], f), nullable=nullable, **when)
    if kinds[0] in ("solver", "same_as"):
        ref = spec[kinds[0]]
        if not isinstance(ref, str) or not ref:
            raise ValueError(f"{name}: {kinds[0]}: expected a name")
        return Param(name, kinds[0], nullable=nullable, **when, **{kinds[0]: ref})
    return _parse_range(name, spec, f, when)


def _parse_range(name: str, spec: dict, f: dataclasses.Field, when: Mapping[str, tuple]) -> Param:
    kind = _field_type(f)
    if kind not in ("int", "float") or f.metadata.get("choices") is not None:
        raise ValueError(f"{name}: not a numeric range knob; list its values with choices:")
    if spec.get("type", kind) != kind:
        raise ValueError(f"{name}: type {shown(spec['type'])} does not match the knob, which is {kind}")
    if "low" not in spec or "high" not in spec or spec["low"] is None or spec["high"] is None:
        raise ValueError(f"{name}: a range needs both low and high")
    low, high = _field_value(name, f, spec["low"], "low "), _field_value(name, f, spec["high"], "high ")
    if not low < high:
        raise ValueError(f"{name}: low ({low}) must be below high ({high}); put a single value under fixed:")
    log, step, at_most = spec.get("log", False), spec.get("step"), spec.get("at_most")
    if not isinstance(log, bool):
        raise ValueError(f"{name}: log: expected true or false")
    if log and low <= 0:
        raise ValueError(f"{name}: a log scale needs low > 0 (got {low})")
    if step is not None:
        numeric = isinstance(step, (int, float)) and not isinstance(step, bool)
        if log or not numeric or step <= 0 or (kind == "int" and not isinstance(step, int)):
            raise ValueError(f"{name}: step must be a positive {kind} and cannot be combined with log")
    if step is not None and not _divides(step, high - low):
        raise ValueError(f"{name}: step {step} does not divide the range {low}..{high} (a search would stop at "
                         f"{low + (high - low) // step * step:.12g}); make high - low a multiple of the step")
    if at_most is not None and not isinstance(at_most, str):
        raise ValueError(f"{name}: at_most: expected a knob name")
    return Param(name, kind, low=low, high=high, log=log, step=step, at_most=at_most,
                 nullable=bool(f.metadata.get("nullable")), **when)


def _divides(step: float, span: float) -> bool:
    """Whether ``span`` is a whole number of steps (to float rounding: 0.45 is 9 steps of 0.05)."""
    k = round(span / step)
    return k >= 1 and abs(k * step - span) <= 1e-9 * max(abs(span), 1.0)


# ---- references between knobs -----------------------------------------------------------------------
def _check_refs(params: list[Param], fixed: dict[str, Any], fields_: Mapping[str, dataclasses.Field]) -> list[Param]:
    by_name: dict[str, Param] = {}
    for p in params:
        if p.name in by_name or p.name in fixed:
            raise ValueError(f"{p.name}: listed twice (a knob is either searched or fixed)")
        by_name[p.name] = p
    out = []
    for p in params:
        when = tuple((ref, _condition_values(p.name, ref, vals, by_name, fixed, fields_)) for ref, vals in p.when)
        when_any = tuple((ref, _condition_values(p.name, ref, vals, by_name, fixed, fields_, "when_any"))
                         for ref, vals in p.when_any)
        for ref in (p.at_most, p.same_as):
            if ref is not None:
                _check_link(p, ref, by_name, fixed, fields_)
        out.append(replace(p, when=when, when_any=when_any))
    return out


def _condition_values(name: str, ref: str, values: tuple, by_name: Mapping[str, Param], fixed: Mapping[str, Any],
                      fields_: Mapping[str, dataclasses.Field], key: str = "when") -> tuple:
    where = f"{name}: {key} {shown_name(ref)}"
    if ref == name:
        raise ValueError(f"{where}: a knob cannot depend on itself")
    target = by_name.get(ref)
    if target is None and ref not in fixed:
        reason = ("not in this space; list it under knobs, switches or fixed" if ref in fields_
                  else _unknown_knob(ref, fields_).partition(": ")[2])
        raise ValueError(f"{where}: {reason}")
    if target is not None and target.kind != "choices":
        raise ValueError(f"{where}: conditions can test only knobs given by choices, switches or fixed knobs, "
                         f"not a {target.kind} knob")
    allowed = target.choices if target is not None else (fixed[ref],)
    keys = _same_keys(allowed) if target is not None else None  # (a fixed value may be no scalar: layer_bits)
    out = []
    for raw in values:
        value = _field_value(ref, fields_[ref], raw, "condition value ") if ref in fields_ else raw
        if not (_among(value, keys) if keys is not None else _same(value, allowed[0])):
            raise ValueError(f"{where}: {shown(raw)} is not one of its values ({_listed(allowed)})")
        out.append(value)
    return tuple(out)


def _check_link(p: Param, ref: str, by_name: Mapping[str, Param], fixed: Mapping[str, Any],
                fields_: Mapping[str, dataclasses.Field]) -> None:
    """``at_most``/``same_as`` read another knob: it must exist, be of the same type, and be known
    before solvers run; a tie must only ever copy values this knob accepts."""
    how = "at_most" if ref == p.at_most else "same_as"
    where = f"{p.name}: {how} {shown_name(ref)}"
    if ref == p.name or ref not in fields_:
        raise ValueError(f"{where}: " + ("a knob cannot refer to itself" if ref == p.name
                                         else _unknown_knob(ref, fields_).partition(": ")[2]))
    if _field_type(fields_[ref]) != _field_type(fields_[p.name]):
        raise ValueError(f"{where}: must be a knob of the same type ({_field_type(fields_[p.name])})")
    target = by_name.get(ref)
    if target is not None and target.kind == "solver":
        raise ValueError(f"{where}: solver-filled knobs are set after sampling; refer to a sampled or fixed knob")
    if how == "same_as":
        for v in _link_values(ref, by_name, fixed):
            _field_value(p.name, fields_[p.name], v, f"value copied from {ref}: ")


def _link_values(ref: str, by_name: Mapping[str, Param], fixed: Mapping[str, Any]) -> tuple:
    """The values (or range ends) a knob can take, as far as the space says; base values are checked
    when a config is built."""
    if ref in fixed:
        return (fixed[ref],)
    target = by_name.get(ref)
    if target is None:
        return ()
    if target.kind == "choices":
        return target.choices
    return (target.low, target.high) if target.kind in ("int", "float") else ()


def param_refs(p: Param) -> list[str]:
    """The knobs and switches ``p`` reads: its conditions, its bound, the knob it copies."""
    return [ref for ref, _ in p.when + p.when_any] + [r for r in (p.at_most, p.same_as) if r is not None]


def _decision_order(params: list[Param]) -> tuple[Param, ...]:
    """File order, except that a knob comes after every knob it reads (stable topological sort)."""
    names = {p.name for p in params}
    deps = {p.name: {r for r in param_refs(p) if r in names} for p in params}
    ordered: list[Param] = []
    done: set[str] = set()
    while len(ordered) < len(params):
        ready = next((p for p in params if p.name not in done and deps[p.name] <= done), None)
        if ready is None:
            stuck = [p.name for p in params if p.name not in done]
            raise ValueError(f"{', '.join(stuck)}: conditions or bounds form a cycle; remove one when/at_most/same_as")
        ordered.append(ready)
        done.add(ready.name)
    return tuple(ordered)


# ---- deciding a point ---------------------------------------------------------------------------------
def _current(name: str, values: Mapping[str, Any], base: KVConfig) -> Any:
    if name in values:
        return values[name]
    family, _, knob = name.partition(".")
    return getattr(getattr(base, family), knob)


def _holds(ref: str, allowed: tuple, decided: Mapping[str, Any], fixed: Mapping[str, Any]) -> bool:
    if ref not in decided and ref not in fixed:
        return False  # what it depends on is itself inactive
    value = decided[ref] if ref in decided else fixed[ref]
    return any(_same(value, a) for a in allowed)


def _is_active(p: Param, decided: Mapping[str, Any], fixed: Mapping[str, Any]) -> bool:
    return (all(_holds(ref, allowed, decided, fixed) for ref, allowed in p.when)
            and (not p.when_any or any(_holds(ref, allowed, decided, fixed) for ref, allowed in p.when_any)))


def _settle_inactive(p: Param, values: dict[str, Any], base: KVConfig) -> None:
    """An inactive knob is null when it may be (the budget of policy 'none'); a tied one keeps its tie (SGLang's
    chunk size is its prefill budget, chunked or not: the base's 8192 under a budget of 3531 was no valid
    config); otherwise it keeps the base value, pulled under its bound so the config stays valid."""
    if p.is_switch:
        return
    if p.nullable:
        values[p.name] = None
    elif p.kind == "same_as":
        values[p.name] = _current(p.same_as, values, base)
    elif p.at_most is not None:
        cap, value = _current(p.at_most, values, base), _current(p.name, values, base)
        if cap is not None and value > cap:
            values[p.name] = cap


def _effective_range(p: Param, values: Mapping[str, Any], base: KVConfig) -> tuple[Any, Any]:
    cap = _current(p.at_most, values, base) if p.at_most is not None else None
    if cap is None:
        return p.low, p.high
    return min(p.low, cap), min(p.high, cap)


def _sample(trial: Any, p: Param, values: Mapping[str, Any], base: KVConfig) -> Any:
    if p.kind == "same_as":
        return _current(p.same_as, values, base)
    if p.kind == "choices":
        return trial.suggest_categorical(p.name, list(p.choices))
    low, high = _effective_range(p, values, base)
    if low == high:
        return low  # the bound leaves one value: pinned, nothing to ask
    if p.kind == "int":
        return trial.suggest_int(p.name, int(low), int(high), step=int(p.step or 1), log=p.log)
    value = trial.suggest_float(p.name, float(low), float(high), step=p.step, log=p.log)
    # a stepped float is low + k x step in binary floating point (0.5700000000000001): the config, its file and
    # the engine flags it exports get the decimal the step means
    return value if p.step is None else float(f"{value:.12g}")


def _build_config(space: SearchSpace, base: KVConfig, values: Mapping[str, Any]) -> KVConfig:
    try:
        return base.with_knobs(values)
    except ValueError as exc:
        raise ValueError(f"space {space.name}: the point is not a valid config ({exc}); gate the knob with when:, "
                         "bound it with at_most: or narrow its range") from None


def _apply_solvers(space: SearchSpace, config: KVConfig, decided: Mapping[str, Any],
                   solvers: Mapping[str, Solver] | None) -> KVConfig:
    """Fill solver knobs in file order, each seeing the config built so far; no solver, no change."""
    for p in space.params:
        if p.kind != "solver" or not solvers or p.solver not in solvers or not _is_active(p, decided, space.fixed):
            continue
        value = solvers[p.solver](config)
        try:
            config = config.with_knobs({p.name: value})
        except ValueError as exc:
            raise ValueError(f"solver {shown(p.solver)} returned an invalid {p.name}: {exc}") from None
    return config


def suggest_config(trial: Any, space: SearchSpace | str, base: KVConfig = KVConfig(),
                   solvers: Mapping[str, Solver] | None = None) -> KVConfig:
    """The config of one Optuna trial: ``trial.suggest_*`` per active knob, named after the knob
    (switches by their name); inactive knobs are not suggested. Fixed knobs override ``base``."""
    space = load_space(space)
    decided: dict[str, Any] = {}
    values: dict[str, Any] = dict(space.fixed)
    for p in space.params:
        if not _is_active(p, decided, space.fixed):
            _settle_inactive(p, values, base)
        elif p.kind != "solver":
            decided[p.name] = _sample(trial, p, values, base)
            if not p.is_switch:
                values[p.name] = decided[p.name]
    return _apply_solvers(space, _build_config(space, base, values), decided, solvers)


# ---- grids ----------------------------------------------------------------------------------------------
def _grid_values(p: Param, values: Mapping[str, Any], base: KVConfig, n: int) -> list[Any]:
    """Choices as listed; ranges as n points, evenly spaced (geometrically on a log scale), both ends
    included, snapped to the step and deduplicated (an integer range may yield fewer than n)."""
    if p.kind == "same_as":
        return [_current(p.same_as, values, base)]
    if p.kind == "choices":
        return list(p.choices)
    low, high = _effective_range(p, values, base)
    if low == high:
        return [low]
    points = np.geomspace(low, high, n) if p.log else np.linspace(low, high, n)
    if p.step:
        top = low + np.floor((high - low) / p.step) * p.step
        points = np.clip(low + np.round((points - low) / p.step) * p.step, low, top)
    cast = (lambda x: int(round(x))) if p.kind == "int" else float
    return list(dict.fromkeys(cast(x) for x in points))


def _walk(space: SearchSpace, base: KVConfig, n: int, i: int, decided: dict[str, Any],
          values: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    if i == len(space.params):
        yield decided, values
        return
    p = space.params[i]
    active = _is_active(p, decided, space.fixed)
    if not active or p.kind == "solver":
        if not active:
            values = dict(values)
            _settle_inactive(p, values, base)
        yield from _walk(space, base, n, i + 1, decided, values)
        return
    for v in _grid_values(p, values, base, n):
        yield from _walk(space, base, n, i + 1, {**decided, p.name: v},
                         values if p.is_switch else {**values, p.name: v})


def _grid(space: SearchSpace, base: KVConfig, points_per_range: int, max_points: int):
    if isinstance(points_per_range, bool) or not isinstance(points_per_range, int) or points_per_range < 2:
        raise ValueError(f"points_per_range: {shown(points_per_range)} must be an integer >= 2 (both ends of each range "
                         "are included)")
    for count, point in enumerate(_walk(space, base, points_per_range, 0, {}, dict(space.fixed)), start=1):
        if count > max_points:
            raise ValueError(f"space {space.name}: the grid has more than {max_points} points at points_per_range="
                             f"{points_per_range}; lower points_per_range, fix some knobs, or raise max_points")
        yield point


def grid_points(space: SearchSpace | str, points_per_range: int = 3, base: KVConfig = KVConfig(), *,
                max_points: int = 100_000) -> list[dict[str, Any]]:
    """Every point of a finite grid as the values decided for it (switches and active knobs, tied and
    pinned ones included; solver knobs excluded), in a deterministic order."""
    space = load_space(space)
    return [decided for decided, _ in _grid(space, base, points_per_range, max_points)]


def grid(space: SearchSpace | str, points_per_range: int = 3, base: KVConfig = KVConfig(),
         solvers: Mapping[str, Solver] | None = None, *, max_points: int = 100_000) -> list[KVConfig]:
    """One config per grid point (see ``grid_points``), for exhaustive benchmarks of small spaces."""
    space = load_space(space)
    return [_apply_solvers(space, _build_config(space, base, values), decided, solvers)
            for decided, values in _grid(space, base, points_per_range, max_points)]


# ---- fitting a space to a machine ---------------------------------------------------------------------
def cap_knob(space: SearchSpace, knob: str, limit: int | float) -> tuple[SearchSpace, tuple]:
    """The space without the values of ``knob`` above ``limit`` (a machine cannot deploy them), and what was
    left out: a choice above it is dropped (the conditions that test the knob keep the values left; a knob
    whose condition no longer holds stays inactive), an integer range is cut at it. A space that does not
    search ``knob``, or none of whose values exceed ``limit``, comes back as it is. Raises ``ValueError``
    when no value is left."""
    try:
        p = space.param(knob)
    except KeyError:
        return space, ()
    if p.kind == "choices":
        kept = tuple(v for v in p.choices if v is None or v <= limit)
        dropped = tuple(v for v in p.choices if v is not None and v > limit)
        if not dropped:
            return space, ()
        if not kept:
            raise ValueError(f"{knob}: every value the search space gives ({_listed(p.choices)}) is "
                             f"above {limit:,.0f}, what this machine can hold")
        capped = replace(p, choices=kept)
    elif p.kind == "int" and p.high > limit:
        if p.low > limit:
            raise ValueError(f"{knob}: the search space's range starts at {p.low:,.0f}, above {limit:,.0f}, what "
                             "this machine can hold")
        capped, dropped = replace(p, high=int(limit)), (f"{int(limit) + 1}..{p.high}",)
    else:
        return space, ()

    def narrowed(q: Param) -> Param:
        if q is p:
            return capped
        if p.kind != "choices":
            return q
        when, when_any = (tuple((ref, tuple(v for v in vals if ref != knob or v in kept)) for ref, vals in conditions)
                          for conditions in (q.when, q.when_any))
        return replace(q, when=when, when_any=when_any)

    return replace(space, params=tuple(narrowed(q) for q in space.params)), dropped
