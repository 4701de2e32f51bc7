"""A shipped hardware profile can be named instead of given as a path (`--profile cpu-smollm2-135m`): installed from
a wheel, the shipped profiles live inside the package, where no user would look for them."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.profile import load_profile, shipped_profiles

REPO_PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def test_the_shipped_profiles_are_the_hardware_profiles_of_the_profiles_folder():
    shipped = shipped_profiles()
    on_disk = {p.stem for p in REPO_PROFILES.glob("*.json") if not p.name.startswith("quality-")}
    assert set(shipped) == on_disk and "cpu-smollm2-135m" in shipped


def test_a_name_loads_the_shipped_profile_and_a_path_still_wins(tmp_path, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (measured on another machine)
        by_name = load_profile("cpu-smollm2-135m")
        by_path = load_profile(REPO_PROFILES / "cpu-smollm2-135m.json")
        assert by_name.to_dict() == by_path.to_dict()
        monkeypatch.chdir(tmp_path)
        (tmp_path / "cpu-smollm2-135m").write_text("{}")  # a file of that name here is what the user means
        with pytest.raises(ValueError, match=r"^cpu-smollm2-135m: "):
            load_profile("cpu-smollm2-135m")


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(ValueError) as refused:
        load_profile("cpu-no-such-model")
    assert str(refused.value) == ("cpu-no-such-model: no such profile file, nor a shipped profile (shipped: "
                                  f"{', '.join(sorted(shipped_profiles()))})")
    with pytest.raises(ValueError, match="cannot read profile"):  # (a path stays a path)
        load_profile("somewhere/cpu-smollm2-135m")


def test_evaluate_takes_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("kv.yaml").write_text("batching:\n  max_num_seqs: 64\n")
    named = CliRunner().invoke(app, ["evaluate", "kv.yaml", "--workload", "chat", "--requests", "20", "--profile",
                                     "cpu-smollm2-135m", "--json"])
    path = CliRunner().invoke(app, ["evaluate", "kv.yaml", "--workload", "chat", "--requests", "20", "--profile",
                                    str(REPO_PROFILES / "cpu-smollm2-135m.json"), "--json"])
    assert named.exit_code == 0, named.output
    assert named.stdout.splitlines()[-1] == path.stdout.splitlines()[-1]


def test_refitting_a_shipped_profile_by_name_needs_out_and_says_where_it_wrote(tmp_path, monkeypatch):
    """`profile --refit cpu-smollm2-135m` had written a file of that name in the working folder, silently, which then
    shadowed the shipped profile there."""
    monkeypatch.chdir(tmp_path)
    refused = CliRunner().invoke(app, ["profile", "--refit", "cpu-smollm2-135m"])
    assert refused.exit_code == 2 and "a shipped profile, which is not written over: give --out FILE" in refused.stderr
    assert not list(tmp_path.iterdir())
    done = CliRunner().invoke(app, ["profile", "--refit", "cpu-smollm2-135m", "--out", "mine.json"])
    assert done.exit_code == 0, done.output
    assert "wrote mine.json" in done.stderr and (tmp_path / "mine.json").is_file()
