"""Long file names: a legal 240-250-byte ``--out`` had been refused ("cannot create a file in . (File name too
long)") because the atomic write's temporary name adds ~20 bytes, and `skistune report` of a 240-character study
name failed with a raw "[Errno 36] File name too long: 'skistune-report-sss...'"."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.paths import check_existing_dir, check_out_file, temporary_name, write_atomic
from skistune.report import check_out_dir, default_out_dir

PROFILE = str(Path(__file__).resolve().parents[1] / "profiles" / "cpu-smollm2-135m.json")


def name_max(folder: Path) -> int:
    return os.pathconf(folder, "PC_NAME_MAX")


@pytest.mark.parametrize("stem", ["a" * 245, "é" * 122, "x" * 250])
def test_a_legal_long_name_is_checked_and_written_whole(tmp_path, stem):
    path = tmp_path / (stem + ".yaml")[-name_max(tmp_path):]
    assert 240 <= len(os.fsencode(path.name)) <= name_max(tmp_path)
    check_out_file(path, "--out")
    write_atomic(path, "kv: 1\n")
    write_atomic(path, "kv: 2\n")  # (replacing it too)
    assert path.read_text() == "kv: 2\n"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left beside it


def test_the_temporary_name_fits_the_file_system_keeps_the_names_start_and_whole_characters(tmp_path):
    limit = name_max(tmp_path)
    for name in ("short.yaml", "a" * 200, "b" * limit, "é" * (limit // 2), "ü" * 100 + "c" * 55):
        tmp = temporary_name(tmp_path, name)
        assert len(os.fsencode(tmp)) <= limit and tmp.endswith(".tmp") and tmp.startswith("." + name[:20])
        tmp.encode("utf-8")  # (cut at a character: no half UTF-8 sequence, which would not encode)
    assert temporary_name(tmp_path, "short.yaml").startswith(".short.yaml.")  # (short names as before)
    assert temporary_name(tmp_path, "b" * limit) != temporary_name(tmp_path, "b" * limit)  # (a random part)
    # two long names alike in their start get different temporary names (the hash of the whole name)
    one, two = ("d" * 240 + end for end in ("1.yaml", "2.yaml"))
    assert temporary_name(tmp_path, one).split(".")[1] != temporary_name(tmp_path, two).split(".")[1]


def test_a_name_longer_than_the_file_system_takes_is_refused_in_one_line(tmp_path):
    too_long = tmp_path / ("z" * (name_max(tmp_path) + 1))
    with pytest.raises(ValueError, match=r"^--out .*z: file name too long$"):
        check_out_file(too_long, "--out")
    with pytest.raises(ValueError, match=r"^--out .*/x.yaml: file name too long$"):
        check_out_file(too_long / "x.yaml", "--out")
    with pytest.raises(ValueError, match=r"^--dir .*z: file name too long$"):
        check_existing_dir(too_long, "--dir")
    with pytest.raises(ValueError, match=r"^--out-dir .*z: file name too long \(give a shorter --out-dir\)$"):
        check_out_dir(too_long)


def test_optimize_writes_a_250_byte_out_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = "o" * 245 + ".yaml"
    r = CliRunner().invoke(app, ["optimize", "--slo", "p99=200ms", "--requests", "16", "--trials", "2",
                                 "--validate", "0", "--profile", PROFILE, "--study", "long", "--out", out])
    assert r.exit_code == 0, r.output
    import yaml

    assert isinstance(yaml.safe_load((tmp_path / out).read_text()), dict)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_the_default_report_folder_of_a_long_study_name_is_shortened_with_a_hash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    limit = name_max(tmp_path)
    assert default_out_dir("t") == Path("skistune-report-t")  # (as before where it fits)
    names = ["s" * 240, "s" * 239 + "2", "é" * 120]
    folders = [default_out_dir(n) for n in names]
    for folder in folders:
        assert len(os.fsencode(folder.name)) <= limit and folder.name.startswith("skistune-report-")
        folder.name.encode("utf-8")
    assert len(set(folders)) == len(folders)  # (names alike in their start: different folders)
    assert default_out_dir(names[0]) == folders[0]  # (the same study: the same folder each time)


def test_report_of_a_240_character_study_name_writes_its_default_folder(tmp_path, monkeypatch):
    import skistune
    from skistune.profile import load_profile
    from skistune.workloads import load_workload

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    monkeypatch.chdir(tmp_path)
    name, storage = "s" * 240, f"sqlite:///{tmp_path / 's.db'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the profile measured on another machine)
        skistune.optimize(load_workload("chat", requests=16, seed=0), slo="p99=200ms", n_trials=2, validate=0,
                          profile=load_profile(PROFILE), storage=storage, study_name=name)
    r = CliRunner().invoke(app, ["report", name, "--storage", storage, "--json"])
    assert r.exit_code == 0, r.output
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("skistune-report-")]
    assert folder == tmp_path / default_out_dir(name) and (folder / "report.html").is_file()

