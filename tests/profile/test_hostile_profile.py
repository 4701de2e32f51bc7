"""Degenerate hardware profiles: every field well-formed, but fitted models that predict no time, an astronomical
time, a bandwidth past any link, or a machine that draws no power. Such a file loaded and optimized to 5,663
req/s at a TBT p99 of 0.0 ms and 0.000 J/token (step coefficients all 0.0), or to null latencies and a 300-digit
"...0.0 ms" (all 1e300). Now it is refused on loading, naming the model and the measured point it fails at."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from profile_tiny import SHIPPED
from test_profile_validation import _set
from typer.testing import CliRunner

from skistune.cli import app
from skistune.profile import FingerprintWarning, load_profile
from skistune.profile.profile import MAX_POWER_W, check_predictions


def _coef(value: float):
    def edit(data):
        model = data["step"]["cost_model"]
        model["coef"] = [value] * len(model["coef"])
    return edit


def _first_step(data) -> str:
    p = data["step"]["points"][0]
    assert p["kind"] == "decode"  # (the tiny grid's first point: what the messages below name)
    g = p["grid"]
    return f"a decode step of {g['batch']} sequence{'s' * (g['batch'] != 1)} at {g['context']} tokens of context"


DEGENERATE = {
    "step coefficients all zero": (_coef(0.0), "step.cost_model: predicted times must be at least 1 µs, finite and "
                                   "under an hour: it predicts 0 ms for {step} (step.points[0])"),
    "step coefficients all 1e300": (_coef(1e300), "step.cost_model: predicted times must be at least 1 µs, finite "
                                    "and under an hour: it predicts {any} s for {step} (step.points[0])"),
    "step coefficients all 1e-20": (_coef(1e-20), "step.cost_model: predicted times must be at least 1 µs, "
                                    "finite and under an hour: it predicts {any} µs for {step} (step.points[0])"),
    "bandwidth 1e300 B/s": (_set(("transfers", "device_to_host", "fit", "bytes_per_s"), 1e300),
                            "transfers.device_to_host.fit.bytes_per_s: 1e+300 B/s is past 1e+15 B/s (1 PB/s)"),
    "copy latency 1e300 s": (_set(("transfers", "host_to_disk", "fit", "latency_s"), 1e300),
                             "transfers.host_to_disk.fit: predicted times must be positive, finite and under an hour: "
                             "it predicts 1e+300 s for a copy of {any} bytes in 1 call "
                             "(transfers.host_to_disk.points[0])"),
    "block conversion coefficients 1e300": (_set(("block_io", "device_to_bytes", "fit", "coef"), [1e300] * 3),
                                            "block_io.device_to_bytes.fit: predicted times must be positive, finite "
                                            "and under an hour: it predicts {any} s for 1 block of"),
    "scheduler overhead of an hour": (_set(("overhead", "fit", "coef"), [3600.0, 0.0]),
                                      "overhead.fit: predicted times must be positive, finite and under an hour: it "
                                      "predicts 3.6e+03 s for scheduling 1 sequence (overhead.points[0])"),
    "no power": (lambda d: (_set(("power", "idle_w"), 0.0)(d), _set(("power", "dynamic_w"), 0.0)(d)),
                 f"power: idle_w + dynamic_w must be positive and below {MAX_POWER_W:,.0f} W (the machine busy), "
                 "got 0 W"),
    "power 1e300 W": (_set(("power", "dynamic_w"), 1e300), "power: idle_w + dynamic_w must be positive and below"),
}


def _pattern(message: str, data: dict) -> str:
    text = re.escape(message).replace(re.escape("{step}"), re.escape(_first_step(data)))
    return text.replace(re.escape("{any}"), r"[-+.e\d,]+")


@pytest.mark.parametrize("edit, message", DEGENERATE.values(), ids=DEGENERATE)
def test_degenerate_profiles_are_refused_on_loading(edited, tiny_profile, edit, message):
    path = edited(edit)
    pattern = _pattern(message, tiny_profile.to_dict())
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {pattern}"):
        load_profile(path, check_fingerprint=False)


@pytest.mark.parametrize("command", [["profile", "--show", "{f}"], ["optimize", "--profile", "{f}", "--trials", "2"],
                                     ["evaluate", "{cfg}", "--profile", "{f}", "--requests", "20"]])
def test_cli_refuses_a_degenerate_profile_in_one_line_with_exit_2(tmp_path: Path, command):
    data = json.loads(SHIPPED.read_text())  # (the tester's: the shipped SmolLM2 profile, its step model zeroed)
    _coef(0.0)(data)
    path, config = tmp_path / "zero.json", tmp_path / "kv.yaml"
    path.write_text(json.dumps(data))
    config.write_text("{}\n")
    args = [a.replace("{f}", str(path)).replace("{cfg}", str(config)) for a in command]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 2, r.output
    last = json.loads(r.stdout.strip().splitlines()[-1])
    pattern = _pattern(DEGENERATE["step coefficients all zero"][1], data)
    assert re.fullmatch(rf"{re.escape(str(path))}: {pattern}; measure the profile again \(`skistune profile`\)",
                        last["error"]), last["error"]
    assert "decode step of 1 sequence at 32 tokens of context" in last["error"]
    assert r.stderr.strip() == f"error: {last['error']}"  # one line: refused before any fingerprint warning


def test_measured_and_shipped_profiles_pass_the_checks(tiny_profile, edited):
    check_predictions(tiny_profile)
    assert load_profile(edited(), check_fingerprint=False).step_cost == tiny_profile.step_cost
    for path in sorted(SHIPPED.parent.glob("c*.json")):  # cpu-..., cuda-... (not the quality profile)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FingerprintWarning)
            check_predictions(load_profile(path))


@pytest.mark.parametrize("text, error", [
    ("[" * 100_000 + "]" * 100_000, "not valid JSON (nested more than 100 levels)"),  # (RecursionError had escaped)
    ('{"format": ' + "9" * 5000 + "}", "not valid JSON (a number of over 4,300 digits)"),
])
def test_hostile_json_is_one_value_error_naming_the_file(tmp_path: Path, text: str, error: str):
    path = tmp_path / "hostile.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(f'{path}: {error}')}$"):
        load_profile(path)
