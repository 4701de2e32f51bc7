"""Reading a profile's JSON fields back, each checked and, when bad, named by where it sits in the file
(``step.points[3].timing.median_s: expected a finite number``). Shared by the records and the step cost model;
imports nothing of either."""
from __future__ import annotations

import math
from typing import Any

from skistune.config import shown


def finite(value: Any, where: str) -> float:
    """A finite number (not a bool, nor a string that float() would take)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: expected a finite number, got {shown(value)}")
    return float(value)


def whole(value: Any, where: str) -> int:
    """An integer (not a bool, a float or a string that int() would take)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected an integer, got {shown(value)}")
    return value


def entry(data: Any, key: str, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    if key not in data:
        raise ValueError(f"{where}.{key}: missing")
    return data[key]


def number(data: Any, key: str, where: str, *, minimum: float = 0.0) -> float:
    value = finite(entry(data, key, where), f"{where}.{key}")
    if value < minimum:
        raise ValueError(f"{where}.{key}: {shown(value)} is below {minimum:g}")
    return value


def integer(data: Any, key: str, where: str, *, minimum: int = 0) -> int:
    value = whole(entry(data, key, where), f"{where}.{key}")
    if value < minimum:
        raise ValueError(f"{where}.{key}: {shown(value)} is below {minimum}")
    return value


def text(data: Any, key: str, where: str, *, choices: tuple[str, ...] | None = None) -> str:
    value = entry(data, key, where)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    if choices is not None and value not in choices:
        raise ValueError(f"{where}.{key}: {shown(value)} is not one of {', '.join(choices)}")
    return value


def items(data: Any, key: str, where: str, *, nonempty: bool = True) -> list:
    value = entry(data, key, where)
    if not isinstance(value, list):
        raise ValueError(f"{where}.{key}: expected a list, got {type(value).__name__}")
    if nonempty and not value:
        raise ValueError(f"{where}.{key}: empty")
    return value


def int_map(data: Any, key: str, where: str) -> dict[str, int]:
    value = entry(data, key, where)
    if not isinstance(value, dict):
        raise ValueError(f"{where}.{key}: expected an object, got {type(value).__name__}")
    return {k: integer(value, k, f"{where}.{key}") for k in value}
