"""Every attribute a study writes fits a MySQL/MariaDB TEXT column (65,535 bytes), where Optuna's RDB storage keeps
each attribute's JSON: the recipe of a study of 400 Mooncake requests is 65 KB of JSON, 550 KB for the trace's
8,000 (MariaDB refused it: "Data too long for column 'value_json'"). A longer study attribute is stored compressed,
in parts (`study_storage.split_attr`), and every reader gets it whole again; one stored whole by an older skistune
reads as it is. (The same on a real MariaDB server: test_mysql_storage.py.)"""
import json
import random
import sqlite3
from pathlib import Path

import optuna
import pytest
from reliability_helpers import PROFILE

import skistune
import skistune.optimize as opt
from skistune.search import ERROR_ATTR, ERROR_ATTR_CHARS, PROBLEM_ATTR
from skistune.study_recipe import RECIPE_ATTR, RECIPE_VERSION, problem_from_recipe
from skistune.study_storage import SPLIT_MARK, joined_attrs, split_attr
from skistune.workloads import load_workload

MOONCAKE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "mooncake_conversation" / \
    "conversation_trace.head.jsonl"
LIMIT = 60_000  # bytes: what each stored attribute must stay under (MySQL's TEXT holds 65,535)
ATTR_TABLES = ("study_user_attributes", "study_system_attributes", "trial_user_attributes", "trial_system_attributes")


def stored_rows(db: Path) -> list[tuple[str, str, int]]:
    """(table, key, bytes of its JSON) of every attribute in an Optuna SQLite file, as the database holds them."""
    with sqlite3.connect(db) as conn:
        return [(table, key, size) for table in ATTR_TABLES
                for key, size in conn.execute(f"SELECT key, length(CAST(value_json AS BLOB)) FROM {table}")]


def test_every_attribute_a_study_of_a_big_trace_writes_stays_under_60000_bytes(tmp_path, profile):
    workload = load_workload(str(MOONCAKE), first=400)
    # (a TBT SLO this CPU profile meets on Mooncake's 8k-token prompts: a feasible study writes its winners too)
    result = skistune.optimize(workload, slo="tbt:p99<=10s", max_queue_s=None, n_trials=3, validate=0, profile=profile,
                               storage=f"sqlite:///{tmp_path / 'big.db'}", study_name="big")
    assert result.feasible
    rows = stored_rows(tmp_path / "big.db")
    assert {key for table, key, _ in rows if table == "study_user_attributes"} >= \
        {RECIPE_ATTR, PROBLEM_ATTR, opt.REFINED_ATTR, opt.CHOSEN_ATTR}
    too_long = [(table, key, size) for table, key, size in rows if size >= LIMIT]
    assert not too_long, too_long
    recipe = result.study.user_attrs[RECIPE_ATTR]  # (read whole again, its parts left out of the attributes)
    assert len(json.dumps(recipe)) > 60_000 and not any("#" in key for key in result.study.user_attrs)
    assert problem_from_recipe(recipe)[0].identity() == result.problem.identity()


@pytest.fixture
def storage(tmp_path):
    return opt.open_storage(f"sqlite:///{tmp_path / 'attrs.db'}")


def _study(storage, name="s"):
    return optuna.create_study(study_name=name, storage=storage)


def noise(chars: int, seed: int = 0) -> str:
    """Text that compression does not shrink much (hex digits: 4 bits a character)."""
    return random.Random(seed).randbytes(chars // 2).hex()


def test_a_split_value_reads_back_whole_and_each_part_is_under_the_limit(tmp_path, storage):
    big = {"arrays": [list(range(i, i + 400)) for i in range(600)], "text": noise(200_000)}  # ~1.4 MB of JSON
    study = _study(storage)
    study.set_user_attr("big", big)
    study.set_user_attr("small", {"a": 1})
    assert optuna.load_study(study_name="s", storage=storage).user_attrs == {"big": big, "small": {"a": 1}}
    rows = stored_rows(tmp_path / "attrs.db")
    assert len(rows) > 3 and all(size < LIMIT for _, _, size in rows)
    assert {key for _, key, _ in rows} >= {"big", "big#a0", "big#a1", "small"}
    # a reader of the raw attributes (another tool) sees the marker and the parts; `joined_attrs` joins them
    raw = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'attrs.db'}").get_study_user_attrs(study._study_id)
    assert raw["big"] == {SPLIT_MARK: raw["big"][SPLIT_MARK]} and joined_attrs(raw)["big"] == big


def test_a_value_rewritten_alternates_slots_so_a_stop_between_its_rows_keeps_the_last_whole(tmp_path, storage):
    first, second = {"v": noise(120_000, 1)}, {"v": noise(200_000, 2)}
    rows = split_attr("k", first)
    assert [k for k, _ in rows][-1] == "k" and all(k.startswith("k#a") for k, _ in rows[:-1])  # marker last
    again = split_attr("k", second, current=rows[-1][1])
    assert all(k.startswith("k#b") for k, _ in again[:-1])  # the other slot: slot a still holds `first` whole
    attrs = {**dict(rows), **dict(again[:-1])}  # stopped before its marker: the old marker, the old parts
    assert joined_attrs(attrs) == {"k": first}
    assert joined_attrs({**attrs, "k": again[-1][1]}) == {"k": second}
    study = _study(storage)
    for value in (first, second, {"v": "small"}, first):  # through the storage: whole, split, whole, split
        study.set_user_attr("k", value)
        assert optuna.load_study(study_name="s", storage=storage).user_attrs == {"k": value}


def test_a_value_stored_whole_by_an_older_skistune_reads_as_it_is(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    plain = optuna.storages.RDBStorage(url)  # (what skistune stored with before: one attribute, whatever its size)
    study = optuna.create_study(study_name="old", storage=plain)
    recipe = {"version": RECIPE_VERSION, "workload": {"arrays": noise(100_000)}}
    study.set_user_attr(RECIPE_ATTR, recipe)
    assert optuna.load_study(study_name="old", storage=opt.open_storage(url)).user_attrs[RECIPE_ATTR] == recipe


def test_damaged_parts_are_named_not_read_as_a_recipe(tmp_path, storage):
    study = _study(storage)
    study.set_user_attr("k", {"v": noise(120_000)})
    optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'attrs.db'}").set_study_user_attr(study._study_id, "k#a1", "xx")
    with pytest.raises(ValueError, match=r"^study attribute k: its 2 stored parts are incomplete or damaged"):
        optuna.load_study(study_name="s", storage=storage).user_attrs


def test_an_error_stored_with_a_trial_is_capped(tmp_path, profile):
    """A trial's attributes are not split: a user's error (any length) is cut short."""
    def failing(metrics):
        raise RuntimeError("y" * 100_000)

    url = f"sqlite:///{tmp_path / 'err.db'}"
    with pytest.raises(RuntimeError):
        skistune.optimize(load_workload("chat", requests=16), slo="p99=200ms", objective=failing, n_trials=1,
                          validate=0, profile=PROFILE, storage=url, study_name="e")
    error = [t for t in optuna.load_study(study_name="e", storage=url).trials if ERROR_ATTR in t.user_attrs]
    assert len(error) == 1 and len(error[0].user_attrs[ERROR_ATTR]) == ERROR_ATTR_CHARS
    assert all(size < LIMIT for _, _, size in stored_rows(tmp_path / "err.db"))
