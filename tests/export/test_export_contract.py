"""The contract every exporter passes, for every engine version it supports: its file parses, it is
deterministic, every knob is expressed, warned about or (for partial targets) out of scope, --strict
fails exactly when there are warnings, and an unknown version names the supported ones."""
from __future__ import annotations

import pytest
import yaml

from export_cases import (GOLDEN_CONFIGS, KNOB_CASES, KNOB_IDS, TARGET_VERSIONS, TV_IDS, config_of,
                          golden_config)
from skistune.config import knob_fields
from skistune.export import EXPORTERS, FALLBACK_MODEL, export, relevant_knobs
from skistune.export.base import Plan
from skistune.runtime.presets import get_preset

pytestmark = pytest.mark.parametrize(("target", "version"), TARGET_VERSIONS, ids=TV_IDS)


def test_every_knob_has_a_case(target, version):
    assert {knob for knob, _, _ in KNOB_CASES} == set(knob_fields())


@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_output_parses_and_is_deterministic(target, version, name):
    first = export(golden_config(name), target, version)
    second = export(golden_config(name), target, version)
    assert first == second
    assert isinstance(yaml.safe_load(first.text), dict)
    assert first.target == target and first.engine_version == version


@pytest.mark.parametrize(("knob", "base", "change"), KNOB_CASES, ids=KNOB_IDS)
def test_a_changed_knob_shows_in_the_file_or_a_warning(target, version, knob, base, change):
    before = export(config_of(base), target, version)
    config = config_of({**base, **change})
    after = export(config, target, version)
    if knob not in EXPORTERS[target].scope:  # a partial target (lmcache, layers) lists it instead
        assert (knob in after.out_of_scope) == (knob in relevant_knobs(config) and change[knob] != knob_fields()[
            knob].default)
        return
    warned = before.warned_knobs() | after.warned_knobs()
    assert after.text != before.text or knob in warned, (
        f"{target} {version}: changing {knob} left the file unchanged and named in no warning")


@pytest.mark.parametrize(("knob", "base", "change"), KNOB_CASES, ids=KNOB_IDS)
def test_every_relevant_knob_is_accounted_for(target, version, knob, base, change):
    config = config_of({**base, **change})
    exporter = EXPORTERS[target]
    plan = Plan(config, target, exporter.scope)
    exporter.render(plan, exporter.version(version), get_preset(FALLBACK_MODEL), exporter.default_file)
    assert plan.unaccounted() == [], f"{target} {version} maps no behaviour for these knobs"
    result = export(config, target, version)
    in_scope = relevant_knobs(config) & EXPORTERS[target].scope
    assert in_scope <= set(result.expressed) | result.warned_knobs()
    assert not set(result.expressed) & result.warned_knobs()
    assert set(result.out_of_scope).isdisjoint(EXPORTERS[target].scope)


@pytest.mark.parametrize(("knob", "base", "change"), KNOB_CASES[::3], ids=KNOB_IDS[::3])
def test_strict_fails_exactly_when_there_are_warnings(target, version, knob, base, change):
    config = config_of({**base, **change})
    result = export(config, target, version)
    if result.warnings:
        with pytest.raises(ValueError, match=r"--strict: .*" + result.warnings[0].knob.replace(".", r"\.")):
            export(config, target, version, strict=True)
    else:
        assert export(config, target, version, strict=True) == result


def test_a_warning_names_the_knob_its_value_and_what_was_written(target, version):
    config = config_of({"eviction.policy": "h2o", "eviction.budget_tokens": 256, "bitwidth.key_bits": 2,
                        "bitwidth.value_bits": 2, "offload.disk_kv_bytes": 1 << 30})
    for w in export(config, target, version).warnings:
        text = str(w)
        assert text.startswith(f"{w.knob}=") and f"wrote {w.written}" in text and w.reason
        assert w.to_dict()["knob"] == w.knob and w.to_dict()["message"] == text


def test_unknown_engine_version_names_the_supported_ones(target, version):
    with pytest.raises(ValueError) as err:
        export(config_of({}), target, "0.0.1-nope")
    for v in EXPORTERS[target].versions:
        assert v.name in str(err.value)


def test_default_version_is_the_newest(target, version):
    newest = EXPORTERS[target].versions[-1].name
    assert export(config_of({}), target).engine_version == newest
    assert export(config_of({}), target, "newest").engine_version == newest


@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_a_companion_is_its_own_targets_file_and_the_command_names_it(target, version, name):
    """A file an export's command needs beside it (vLLM's LMCache file) is written by the one exporter of that
    file, never a second rendering of it, and is named in the command line."""
    result = export(golden_config(name), target, version)
    for c in result.companions:
        assert c.text == export(golden_config(name), c.target, c.engine_version).text
        assert c.file_name in result.command
