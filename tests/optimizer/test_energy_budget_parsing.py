"""Energy budgets as a tester wrote them: exponents with a plus sign (what Python's repr of a large float writes),
subnormal budgets (every violation had been infinite), huge Python integers (a 400-digit message)."""
from __future__ import annotations

import pytest

from skistune.objectives import parse_energy
from skistune.problem import _parse_specs


@pytest.mark.parametrize("text, joules", [("5e+1J/token", 50.0), ("5e1J/token", 50.0), ("2.5E-1 J/token", 0.25),
                                          ("300mJ/token", 0.3)])
def test_exponents_with_either_sign_parse(text, joules):
    assert parse_energy(text).limit_j_per_token == pytest.approx(joules)


@pytest.mark.parametrize("number", [1e16, 1e308, 0.5])
def test_every_python_float_is_a_budget(number):
    """A Python number is J/token: its repr (1e+16 and up) must parse too."""
    assert _parse_specs((), number, ())[1].limit_j_per_token == number


def test_a_budget_no_hardware_could_meet_is_refused_before_it_breaks_the_arithmetic():
    with pytest.raises(ValueError, match=r"^energy '1e-320J/token': below 1e-12 J/token"):
        parse_energy("1e-320J/token")
    assert parse_energy("1e-12J/token").violation  # (the floor itself is a budget)


def test_a_huge_integer_is_refused_in_a_short_line():
    with pytest.raises(ValueError) as refused:
        _parse_specs((), 10**400, ())
    assert "must be a finite number" in str(refused.value)
    assert len(str(refused.value)) < 200
