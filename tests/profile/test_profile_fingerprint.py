"""A profile measured on another fingerprint loads, with a warning that names what differs."""
from __future__ import annotations

import warnings

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.profile import (
    Fingerprint,
    FingerprintWarning,
    fingerprint_diff,
    load_profile,
    machine_fingerprint,
)


def _elsewhere(data):
    data["fingerprint"]["cpu_model"] = "Imaginary CPU 9000"
    data["fingerprint"]["torch_version"] = "1.0.0"


def test_this_machine_loads_without_warning(edited):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FingerprintWarning)
        load_profile(edited())


def test_another_fingerprint_warns_naming_the_fields(edited):
    path = edited(_elsewhere)
    with pytest.warns(FingerprintWarning) as record:
        profile = load_profile(path)
    message = str(record[0].message)
    assert str(path) in message
    assert "cpu_model: Imaginary CPU 9000 -> " in message and "torch_version: 1.0.0 -> " in message
    assert "threads" not in message and "date" not in message
    assert profile.fingerprint.cpu_model == "Imaginary CPU 9000"


def test_the_date_is_recorded_but_never_compared(edited):
    path = edited(lambda data: data["fingerprint"].update(date="1999-01-01T00:00:00+00:00"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FingerprintWarning)
        assert load_profile(path).fingerprint.date == "1999-01-01T00:00:00+00:00"


def test_cli_show_prints_the_warning_on_one_line(edited):
    result = CliRunner().invoke(app, ["profile", "--show", str(edited(_elsewhere))])
    assert result.exit_code == 0, result.output
    warning_lines = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning_lines) == 1 and "cpu_model" in warning_lines[0] and "torch_version" in warning_lines[0]
    assert "step fit R²" in result.stdout


def test_diff_and_cache_key_ignore_only_the_date():
    here = machine_fingerprint("cpu")
    later = Fingerprint(**{**here.to_dict(), "date": "2099-01-01T00:00:00+00:00"})
    other = Fingerprint(**{**here.to_dict(), "threads": here.threads + 1, "gpu_model": "H200"})
    assert fingerprint_diff(here, later) == [] and here.key() == later.key()
    assert fingerprint_diff(here, other) == [f"threads: {here.threads} -> {here.threads + 1}",
                                             "gpu_model: None -> H200"]
    assert here.key() != other.key()


def test_fingerprint_describes_this_machine():
    import os

    import torch

    fp = machine_fingerprint("cpu")
    assert fp.cpu_count == os.cpu_count() and fp.threads == torch.get_num_threads()
    assert fp.torch_version == torch.__version__ and fp.gpu_model is None and fp.cuda_version is None
    assert fp.cpu_model and fp.skistune_version and fp.python_version
