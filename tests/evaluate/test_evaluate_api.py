"""The Python API of evaluation: `skistune.evaluate` takes a config (object, mapping or file) and a workload
or requests, and bad input is a clear TypeError/ValueError before anything runs; the documented functions
are reachable from `import skistune`, which stays light."""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import skistune
from skistune.config import KVConfig
from skistune.evaluate import evaluate, workload_requests
from skistune.workloads import load_workload

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


@pytest.fixture(scope="module")
def workload():
    return load_workload("chat", requests=3, max_input=32, max_output=4)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the shipped profile was measured on another machine)
        yield


def test_a_workload_a_mapping_and_a_file_are_taken_as_their_obvious_forms(workload, tmp_path):
    reqs = workload_requests(workload, "smollm2-135m")
    expected = evaluate(KVConfig().with_knobs({"batching.max_num_seqs": 2}), reqs, profile=PROFILE)
    path = tmp_path / "kv.yaml"
    path.write_text("batching:\n  max_num_seqs: 2\n")
    for config in ({"batching": {"max_num_seqs": 2}}, str(path), path):
        m = evaluate(config, workload, profile=PROFILE)
        assert m.num_finished == 3 and m.ttft_s == expected.ttft_s and m.duration_s == expected.duration_s


@pytest.mark.parametrize("call, error, message", [
    (lambda w: evaluate(KVConfig(), 3, profile=PROFILE), TypeError, "requests: expected a Workload"),
    (lambda w: evaluate(KVConfig(), "chat", profile=PROFILE), TypeError, "requests: expected a Workload"),
    (lambda w: evaluate(KVConfig(), [1, 2], profile=PROFILE), TypeError, "requests: expected Request items, got int"),
    (lambda w: evaluate(KVConfig(), [], profile=PROFILE), ValueError, "requests: empty"),
    (lambda w: evaluate(42, w, profile=PROFILE), TypeError, "config: expected a KVConfig, a mapping"),
    (lambda w: evaluate({"batching": {"max_num_seqs": 0}}, w, profile=PROFILE), ValueError, "batching.max_num_seqs"),
    (lambda w: evaluate("no-such.yaml", w, profile=PROFILE), ValueError, "no-such.yaml: cannot read config"),
    (lambda w: evaluate(KVConfig(), w, profile=3), TypeError, "profile: expected a HardwareProfile"),
    (lambda w: evaluate(KVConfig(), w, mode="compare"), ValueError, "mode 'compare': use simulate or run"),
    (lambda w: evaluate(KVConfig(), w, model="gpt-5"), ValueError, "model 'gpt-5': unknown preset"),
])
def test_bad_input_is_a_clear_error_before_anything_runs(workload, call, error, message):
    with pytest.raises(error, match=message):
        call(workload)


def test_the_documented_functions_are_reachable_from_the_package(workload):
    from skistune import config, simulator, workloads

    assert skistune.KVConfig is config.KVConfig and skistune.load_config is config.load_config
    assert skistune.simulate is simulator.simulate and skistune.capacity is simulator.capacity
    assert skistune.load_workload is workloads.load_workload
    m = skistune.evaluate(KVConfig(), workload, profile=PROFILE)  # (the module, callable as its function)
    assert m.num_finished == 3
    target = skistune.sim_target("smollm2-135m", PROFILE)
    assert skistune.simulate(KVConfig(), workload_requests(workload, "smollm2-135m"), target).ttft_s == m.ttft_s
    assert {"evaluate", "simulate", "capacity", "KVConfig", "optimize"} <= set(skistune.__all__)


def test_import_stays_light_and_a_module_import_after_the_attribute_gets_the_module():
    """`import skistune` loads none of its submodules; reaching `skistune.evaluate` first and importing the
    module afterwards (``import skistune.evaluate as e``) still gives the module, for evaluate and optimize."""
    code = ("import sys, inspect, skistune\n"
            "assert [m for m in sys.modules if m.startswith('skistune.')] == [], sys.modules\n"
            "assert 'torch' not in sys.modules and 'optuna' not in sys.modules\n"
            "f, g = skistune.evaluate, skistune.optimize\n"
            "import skistune.evaluate as e, skistune.optimize as o\n"
            "assert e.fit_workload and o.build_problem and callable(e) and callable(o)\n"
            "assert 'requests' in inspect.signature(skistune.evaluate).parameters\n"
            "assert 'objective' in inspect.signature(skistune.optimize).parameters\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(PROFILE).parents[2])
    assert r.returncode == 0, r.stderr
