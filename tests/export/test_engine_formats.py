"""Each engine's own file rules (the project's engine reference, engines-and-algorithms.md, kept outside this
repository, §1-3), and the file and the command line saying the same thing."""
from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml

from skistune.runtime.eviction_budget import layer_budgets as runtime_layer_budgets
from skistune.runtime.presets import get_preset

from export_cases import DISK, GIB, GOLDEN_CONFIGS, H2O, HOST, HOST_PREFETCH, config_of, golden_config
from skistune.export import export, layer_budgets

SMOLLM = get_preset("smollm2-135m")  # the default model: 30 layers, an 8192-token context

LMCACHE_KEYS = {"chunk_size", "local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size", "use_layerwise"}
KV_CACHE_CONFIG_FIELDS = {"enable_block_reuse", "max_tokens", "max_attention_window", "sink_token_length",
                          "free_gpu_memory_fraction", "host_cache_size", "onboard_blocks", "dtype", "tokens_per_block"}


def flags_from_yaml(data: dict, false_kept: bool) -> list[str]:
    """argv as the engines' YAML loaders build it: true -> bare flag, false -> dropped (vLLM; SGLang skips a
    store_true flag's false), list -> several values, anything else -> its string."""
    argv: list[str] = []
    for key, value in data.items():
        if value is False and not false_kept:
            continue
        argv.append(f"--{key}")
        if value is not True:
            argv.extend(str(v) for v in (value if isinstance(value, list) else [value]))
    return argv


@pytest.mark.parametrize("version", ["0.11", "main-002f10e0"])
@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_vllm_yaml_is_flat_dashed_without_false_and_matches_the_command(version, name):
    result = export(golden_config(name), "vllm", version)
    data = yaml.safe_load(result.text)
    assert all("_" not in k and v is not False and not isinstance(v, dict) for k, v in data.items())
    argv = shlex.split(result.command)
    start = argv.index("serve") + 2  # vllm serve MODEL --flags...
    assert argv[start:] == flags_from_yaml(data, false_kept=False)
    if "kv-transfer-config" in data:
        assert json.loads(data["kv-transfer-config"])["kv_role"] == "kv_both"


def test_vllm_writes_off_switches_in_their_no_form():
    data = yaml.safe_load(export(config_of({"prefix_reuse.enabled": False, "batching.chunked_prefill": False}),
                                 "vllm").text)
    assert data["no-enable-prefix-caching"] is True and "enable-prefix-caching" not in data
    assert data["no-enable-chunked-prefill"] is True and "long-prefill-token-threshold" not in data


def test_vllm_host_offload_per_version():
    old = yaml.safe_load(export(config_of(HOST_PREFETCH), "vllm", "0.11").text)
    connector = json.loads(old["kv-transfer-config"])
    assert connector["kv_connector"] == "OffloadingConnector"
    # smollm2-135m: 30 layers x 3 KV heads x 64 dims x 2 (K and V) x 2 bytes = 23040 bytes/token, 16-token blocks
    assert connector["kv_connector_extra_config"] == {"block_size": 16, "num_cpu_blocks": 8 * GIB // (23040 * 16)}
    new = yaml.safe_load(export(config_of(HOST_PREFETCH), "vllm", "main-002f10e0").text)
    assert new["kv-offloading-size"] == 8.0 and new["kv-offloading-backend"] == "native"
    assert "kv-transfer-config" not in new


def test_vllm_0_11_sizes_cpu_blocks_at_the_kv_dtypes_bytes():
    """Guards against sizing vLLM 0.11's num_cpu_blocks at 16-bit bytes per block for an fp8 KV cache, which
    gives the OffloadingConnector half the host blocks asked for."""
    def cpu_blocks(bits):
        config = config_of({"bitwidth.key_bits": bits, "bitwidth.value_bits": bits, "offload.host_kv_bytes": GIB})
        data = yaml.safe_load(export(config, "vllm", "0.11", model="llama-3-8b").text)
        return json.loads(data["kv-transfer-config"])["kv_connector_extra_config"]["num_cpu_blocks"]

    # llama-3-8b: 32 layers x 8 KV heads x 128 dims x 2 (K and V) = 65536 values a token, 16-token blocks
    assert cpu_blocks(8) == GIB // (65536 * 1 * 16) == 1024
    assert cpu_blocks(16) == GIB // (65536 * 2 * 16) == 512


@pytest.mark.parametrize("version", ["0.11", "main-002f10e0"])
def test_vllm_disk_tier_goes_through_a_real_lmcache_file(version):
    """LMCache's settings were comments in the vLLM YAML (and LMCACHE_* variables in the command): the export
    now carries the LMCache file itself as a companion, the very file --to lmcache writes, and the command
    names it in LMCACHE_CONFIG_FILE."""
    config = config_of({**HOST_PREFETCH, **DISK, "prefetch.unit": "layers", "prefetch.depth": 1,
                        "offload.write_policy": "write_through"})
    result = export(config, "vllm", version, file_name="out/vllm.yaml")
    data = yaml.safe_load(result.text)
    assert json.loads(data["kv-transfer-config"])["kv_connector"] == "LMCacheConnectorV1"
    assert not result.warnings and "LMCACHE" not in "".join(f"{k}{v}" for k, v in data.items())
    [companion] = result.companions
    assert (companion.target, companion.file_name) == ("lmcache", "out/vllm-lmcache.yaml")  # named after the file
    assert companion.text == export(config, "lmcache").text  # one code path: the same file, byte for byte
    assert yaml.safe_load(companion.text) == {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 8.0,
                                              "local_disk": "file:///var/tmp/skistune-lmcache/",
                                              "max_local_disk_size": 100.0, "use_layerwise": True}
    assert shlex.split(result.command)[:3] == ["LMCACHE_CONFIG_FILE=out/vllm-lmcache.yaml", "vllm", "serve"]
    assert "#   LMCACHE_CONFIG_FILE=out/vllm-lmcache.yaml vllm serve MODEL --config out/vllm.yaml\n" in result.text


def test_vllm_without_a_disk_tier_has_no_companion():
    assert export(config_of(HOST), "vllm").companions == () and export(config_of(HOST), "vllm", "0.11").companions == ()


def test_vllm_h2o_and_2bit_warn_with_the_nearest_setting():
    result = export(config_of({**H2O, "bitwidth.key_bits": 2, "bitwidth.value_bits": 2}), "vllm")
    written = {w.knob: w.written for w in result.warnings}
    assert written == {"eviction.policy": "no eviction (every token kept)", "bitwidth.key_bits": "fp8",
                       "bitwidth.value_bits": "fp8"}
    assert yaml.safe_load(result.text)["kv-cache-dtype"] == "fp8"


def test_vllm_per_layer_bits_use_skip_layers_only_where_the_version_has_them():
    config = config_of({"bitwidth.layer_bits": [[8, 8]] * 28 + [[16, 16]] * 2})
    new = export(config, "vllm", "main-002f10e0")
    assert yaml.safe_load(new.text)["kv-cache-dtype-skip-layers"] == [28, 29] and not new.warnings
    old = export(config, "vllm", "0.11")
    assert yaml.safe_load(old.text)["kv-cache-dtype"] == "auto"
    assert [w.knob for w in old.warnings] == ["bitwidth.layer_bits"]


@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_sglang_yaml_is_dashed_and_matches_the_command(name):
    result = export(golden_config(name), "sglang")
    data = yaml.safe_load(result.text)
    assert all("_" not in k and v is not False for k, v in data.items())
    argv = shlex.split(result.command)
    assert argv[:5] == ["python", "-m", "sglang.launch_server", "--model-path", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert argv[5:] == flags_from_yaml(data, false_kept=False)


def test_sglang_mappings():
    data = yaml.safe_load(export(config_of({"prefix_reuse.enabled": False, "batching.chunked_prefill": False,
                                            "batching.policy": "prefix"}), "sglang").text)
    assert data["disable-radix-cache"] is True and data["chunked-prefill-size"] == -1
    # longest-prefix-first over a disabled radix cache has nothing to match: fcfs, said in a note (a tester)
    assert data["schedule-policy"] == "fcfs"
    on = export(config_of({"batching.policy": "prefix"}), "sglang")
    assert yaml.safe_load(on.text)["schedule-policy"] == "lpm" and not any("lpm" in n or "prefix match" in n
                                                                            for n in on.notes)
    hicache = export(config_of({**HOST, "offload.host_kv_bytes": 32 * 10**9}), "sglang")
    data = yaml.safe_load(hicache.text)
    assert data["enable-hierarchical-cache"] is True and data["hicache-size"] == 32
    assert data["hicache-write-policy"] == "write_back"


SGLANG_EXACT = {"prefetch.enabled": True, "prefetch.unit": "layers", "prefetch.depth": 1,
                "batching.chunk_size": 2048}  # prefetch and a chunk cap SGLang expresses: no other warning


@pytest.mark.parametrize(("host_gb", "device_gb", "larger"), [(12, 10, True), (10, 10, False), (6, 10, False)])
def test_sglang_hicache_size_is_the_host_pool_as_asked(host_gb, device_gb, larger):
    """--hicache-size is the host pool in GB per rank and overrides --hicache-ratio (reference §2), so a 12 GB
    host tier over a 10 GB device pool is hicache-size 12, exact. The exporter used to raise it to twice
    the device pool (20), the design doc's minimum for the ratio, doubling the tuned host tier. A host pool
    not larger than the device pool is written as asked too, with a note on SGLang's own check."""
    result = export(config_of({**SGLANG_EXACT, "offload.device_kv_bytes": device_gb * 10**9,
                               "offload.host_kv_bytes": host_gb * 10**9}), "sglang")
    assert yaml.safe_load(result.text)["hicache-size"] == host_gb and not result.warnings
    assert "offload.host_kv_bytes" in result.expressed
    assert any(n.startswith(f"hicache-size {host_gb} GB is not larger than the device pool") for n in result.notes) \
        is not larger


def test_lmcache_keys_and_units():
    data = yaml.safe_load(export(config_of({**HOST_PREFETCH, **DISK}), "lmcache").text)
    assert set(data) <= LMCACHE_KEYS
    assert data["local_cpu"] is True and data["max_local_cpu_size"] == 8.0 and data["max_local_disk_size"] == 100.0
    assert data["local_disk"].startswith("file:///") and data["use_layerwise"] is True
    off = yaml.safe_load(export(config_of({}), "lmcache").text)
    assert off["local_cpu"] is False and off["local_disk"] is None


@pytest.mark.parametrize("version", ["pre-pr12449", "post-pr12449"])
def test_trtllm_blocks_and_onboarding_per_version(version):
    data = yaml.safe_load(export(config_of(HOST), "trtllm", version).text)
    assert set(data) == {"max_batch_size", "max_num_tokens", "enable_chunked_prefill", "kv_cache_config",
                         "scheduler_config"}
    assert set(data["kv_cache_config"]) <= KV_CACHE_CONFIG_FIELDS
    assert data["kv_cache_config"]["host_cache_size"] == 8 * GIB
    assert ("onboard_blocks" in data["kv_cache_config"]) == (version == "pre-pr12449")


def test_trtllm_streaming_is_a_window_with_sinks():
    config = config_of({"eviction.policy": "streaming", "eviction.budget_tokens": 1000, "eviction.sink_tokens": 4,
                        "eviction.layer_schedule": "pyramid"})
    kv = yaml.safe_load(export(config, "trtllm").text)["kv_cache_config"]
    assert kv["max_attention_window"] == layer_budgets(config, SMOLLM) and kv["sink_token_length"] == 4
    uniform = yaml.safe_load(export(config.with_knobs({"eviction.layer_schedule": "uniform"}), "trtllm").text)
    assert uniform["kv_cache_config"]["max_attention_window"] == [1000]  # one entry, repeated across layers


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3-8b", "llama-3.1-70b"])
def test_layers_has_one_entry_per_layer_of_the_model(model):
    from skistune.runtime.presets import get_preset
    config = config_of({**H2O, "eviction.layer_schedule": "pyramid", "bitwidth.key_bits": 4})
    data = yaml.safe_load(export(config, "layers", model=model).text)
    n = get_preset(model).n_layers
    assert list(data) == list(range(n))
    expected = runtime_layer_budgets(config.eviction, n, 256)  # what the runtime keeps per layer
    assert data[0] == {"nbits_key": 4, "nbits_value": 16, "budget": expected[0]}
    assert data[n - 1] == {"nbits_key": 4, "nbits_value": 16, "budget": expected[-1]}
    assert expected[0] > 256 > expected[-1]


def test_layers_rejects_per_layer_bits_of_another_model(tmp_path):
    with pytest.raises(ValueError, match="12 .* pairs, but model smollm2-135m has 30 layers"):
        export(config_of({"bitwidth.layer_bits": [[4, 4]] * 12}), "layers")
    path = tmp_path / "lb.yaml"  # (from a file, the error names it, as the file's other faults do)
    path.write_text("bitwidth:\n  layer_bits: [[8, 8]]\n")
    for target in ("layers", "vllm"):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: bitwidth.layer_bits: 1 \[key, value\] pairs"):
            export(path, target)


def test_layer_budgets_schedules():
    uniform = config_of(H2O)
    assert layer_budgets(uniform, SMOLLM) == [256] * 30
    pyramid = config_of({**H2O, "eviction.layer_schedule": "pyramid"})
    budgets = layer_budgets(pyramid, SMOLLM)
    assert budgets == runtime_layer_budgets(pyramid.eviction, 30, 256)  # one schedule: the runtime's
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > 256 > budgets[-1]
    fraction = config_of({"eviction.policy": "snapkv", "eviction.budget_fraction": 0.5,
                          "eviction.layer_schedule": "pyramid"})
    shares = layer_budgets(fraction, SMOLLM)
    assert shares == sorted(shares, reverse=True) and abs(sum(shares) / 30 - 0.5) < 1e-3
    # the runtime's pyramid at the model's full context, as shares of it
    assert shares == [round(b / 8192, 6) for b in runtime_layer_budgets(fraction.eviction, 30, 8192)]
    assert layer_budgets(config_of({"eviction.policy": "snapkv", "eviction.budget_fraction": 0.1}), SMOLLM) == \
        [0.1] * 30  # uniform: the fraction itself, at every context
    assert layer_budgets(config_of({}), SMOLLM) == [None] * 30


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.1-70b"])
@pytest.mark.parametrize("fraction", [0.25, 0.9])
def test_trtllm_and_layers_write_one_schedule_for_a_fraction_budget(model, fraction):
    """A pyramid fraction budget: TensorRT-LLM's windows are the `layers` file's shares of the same context,
    and the warning says what the file holds (a per-layer list, not one window)."""
    config = config_of({"eviction.policy": "streaming", "eviction.budget_fraction": fraction,
                        "eviction.layer_schedule": "pyramid"})
    spec = get_preset(model)
    result = export(config, "trtllm", model=model)
    windows = yaml.safe_load(result.text)["kv_cache_config"]["max_attention_window"]
    shares = yaml.safe_load(export(config, "layers", model=model).text)
    assert len(windows) == spec.n_layers and windows[0] > windows[-1]
    assert windows == [round(shares[layer]["budget"] * spec.max_context) for layer in range(spec.n_layers)]
    assert windows == runtime_layer_budgets(config.eviction, spec.n_layers, spec.max_context) or fraction == 0.9
    assert max(windows) <= spec.max_context  # capped: a layer keeps at most the whole context (share 1.0)
    written = {w.knob: w.written for w in result.warnings}["eviction.budget_fraction"]
    assert written.startswith(f"per-layer max_attention_window {windows[0]} (layer 0) down to {windows[-1]} "
                              f"(layer {spec.n_layers - 1})")


def test_trtllm_fraction_budget_uniform_is_one_window():
    config = config_of({"eviction.policy": "streaming", "eviction.budget_fraction": 0.25})
    result = export(config, "trtllm")
    assert yaml.safe_load(result.text)["kv_cache_config"]["max_attention_window"] == [2048]
    written = {w.knob: w.written for w in result.warnings}["eviction.budget_fraction"]
    assert written == "max_attention_window 2048 (of smollm2-135m's 8192-token context)"


@pytest.mark.parametrize("version", ["0.11", "main-002f10e0"])
def test_configs_of_the_vllm_search_space_export_to_vllm_without_warnings(version):
    """`skistune optimize --target vllm` searches searchspace/vllm.yaml: whatever it finds must deploy as tuned,
    chunked prefill off with a budget below the model's context included (the model length is capped at the
    budget, noted: the runtime refuses the same requests)."""
    import optuna

    from skistune.searchspace import load_space, suggest_config

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = load_space("vllm")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    capped = 0
    for _ in range(40):
        trial = study.ask()
        config = suggest_config(trial, space)
        b = config.batching
        result = export(config, "vllm", version)
        assert not result.warnings
        capped += "max-model-len" in yaml.safe_load(result.text)
        assert ("max-model-len" in yaml.safe_load(result.text)) == (not b.chunked_prefill
                                                                    and b.max_num_batched_tokens < 8192)
        study.tell(trial, 0.0)
    assert capped  # the draws reach the capped combination


@pytest.mark.parametrize("target", ["native", "lmcache", "trtllm"])
def test_commands_quote_the_file_name(target):
    result = export(config_of(HOST), target, file_name="my dir/kv cfg.yaml")
    argv = shlex.split(result.command)
    assert "my dir/kv cfg.yaml" in argv or "LMCACHE_CONFIG_FILE=my dir/kv cfg.yaml" in argv


def test_vllm_command_quotes_the_lmcache_file_name():
    result = export(config_of({**HOST, **DISK}), "vllm", file_name="my dir/kv cfg.yaml")
    argv = shlex.split(result.command)
    assert argv[:4] == ["LMCACHE_CONFIG_FILE=my dir/kv cfg-lmcache.yaml", "vllm", "serve",
                        "HuggingFaceTB/SmolLM2-135M-Instruct"]


@pytest.mark.parametrize(("target", "version", "written"), [
    ("vllm", "main-002f10e0", "kv-offloading-size 0.001 (1073742 bytes)"),
    ("vllm", "0.11", "num_cpu_blocks 1 (368640 bytes)"),  # 16-token blocks of 23040 bytes per token
    ("lmcache", "main-000620e3", "max_local_cpu_size 0.001 (1073742 bytes)"),
    ("sglang", "main-001067ff", "hicache-size 1"),
])
def test_a_tiny_host_pool_rounded_up_is_warned(target, version, written):
    result = export(config_of({"offload.host_kv_bytes": 1000}), target, version)
    assert {w.knob: w.written for w in result.warnings}["offload.host_kv_bytes"] == written


def test_tiny_lmcache_sizes_through_vllm_name_the_lmcache_file_keys():
    result = export(config_of({"offload.host_kv_bytes": 1000, "offload.disk_kv_bytes": 5000}), "vllm")
    written = {w.knob: w.written for w in result.warnings}
    assert written["offload.host_kv_bytes"].startswith("max_local_cpu_size 0.001")
    assert written["offload.disk_kv_bytes"].startswith("max_local_disk_size 0.001")
    assert yaml.safe_load(result.companions[0].text)["max_local_cpu_size"] == 0.001


@pytest.mark.parametrize(("target", "version"), [("vllm", "main-002f10e0"), ("vllm", "0.11"),
                                                 ("lmcache", "main-000620e3")])
@pytest.mark.parametrize("host", [8 * GIB, 10**9, 3 * 10**6, 700_000])
def test_host_sizes_within_the_printed_rounding_are_not_warned(target, version, host):
    """Only a size the engine's unit or a floor moves beyond rounding is warned: 3 MB is 0.003 GiB (0.3% off
    after rounding to three decimals), 700 kB is 0.001 GiB (its nearest), 1e9 bytes is 0.931 GiB."""
    result = export(config_of({"offload.host_kv_bytes": host}), target, version)
    warned = "offload.host_kv_bytes" in result.warned_knobs()
    # vLLM 0.11's whole blocks (368640 bytes) cannot hold 700 kB within 2%: one block is written, and warned
    assert warned == (version == "0.11" and host == 700_000)


def test_trtllm_swap_warning_says_what_is_written():
    result = export(config_of({"batching.preemption": "swap"}), "trtllm")
    [warning] = [w for w in result.warnings if w.knob == "batching.preemption"]
    assert warning.written == "capacity_scheduler_policy GUARANTEED_NO_EVICT (no preemption)"
    assert "recompute" not in str(warning)
    assert yaml.safe_load(result.text)["scheduler_config"]["capacity_scheduler_policy"] == "GUARANTEED_NO_EVICT"


def test_vllm_dtype_warnings_mention_only_the_exported_versions_dtypes():
    config = config_of({"bitwidth.key_bits": 4, "bitwidth.value_bits": 4})
    old = export(config, "vllm", "0.11")
    assert old.warnings and not any("newest" in str(w) or "nvfp4" in str(w) for w in old.warnings)
    new = export(config, "vllm", "main-002f10e0")
    assert any("nvfp4" in str(w) for w in new.warnings)


@pytest.mark.parametrize("version", ["0.11", "main-002f10e0"])
def test_vllm_without_chunked_prefill_caps_the_model_length_at_the_budget(version):
    """vLLM's SchedulerConfig refuses max_num_batched_tokens < max_model_len with chunked prefill off: the
    model length is capped at the budget and noted: longer requests are refused, as the runtime refuses them
    (it had been a warning while the runtime let the output run on to the model's context)."""
    config = config_of({"batching.chunked_prefill": False, "batching.max_num_batched_tokens": 2048})
    result = export(config, "vllm", version)
    data = yaml.safe_load(result.text)
    assert data["no-enable-chunked-prefill"] is True and data["max-model-len"] == 2048
    assert not result.warnings and "batching.chunked_prefill" in result.expressed
    [note] = [n for n in result.notes if n.startswith("chunked prefill off")]
    assert "requests longer than 2048 tokens, prompt and output together, are refused" in note
    export(config, "vllm", version, strict=True)  # (exact: --strict has nothing to refuse)
    # a budget that covers the model's context, or chunked prefill on, needs no cap
    for knobs in ({"batching.chunked_prefill": False, "batching.max_num_batched_tokens": 8192},
                  {"batching.max_num_batched_tokens": 2048}):
        result = export(config_of(knobs), "vllm", version)
        assert "max-model-len" not in yaml.safe_load(result.text) and not result.warnings
    assert yaml.safe_load(export(config, "vllm", version, model="llama-3.1-70b").text)["max-model-len"] == 2048


ENGINES = [("vllm", "0.11"), ("vllm", "main-002f10e0"), ("sglang", "main-001067ff"), ("lmcache", "main-000620e3"),
           ("trtllm", "pre-pr12449"), ("trtllm", "post-pr12449")]


@pytest.mark.parametrize(("target", "version"), ENGINES)
@pytest.mark.parametrize("tiers", [HOST, DISK, {**HOST, **DISK}], ids=["host", "disk", "host+disk"])
def test_a_tier_with_prefix_reuse_off_is_warned_by_every_engine(target, version, tiers):
    """skistune's tiers serve only prefix-reuse hits: with reuse off the tuned run never used them, while every
    engine's tier serves prefix-cache hits, so every exporter warns the same way and --strict fails."""
    config = config_of({**tiers, "prefix_reuse.enabled": False})
    result = export(config, target, version)
    warned = [w for w in result.warnings if w.knob == "prefix_reuse.enabled"]
    if target == "trtllm" and tiers == DISK:  # no disk tier is written (warned itself): nothing to conflict
        assert warned == []
        return
    [warning] = warned
    assert "skistune's host and disk tiers serve only prefix-reuse hits" in warning.reason
    assert "prefix" in warning.reason.partition(";")[0]  # the engine's tier serves prefix hits, in its terms
    with pytest.raises(ValueError, match=r"--strict: .*prefix_reuse\.enabled=false"):
        export(config, target, version, strict=True)
    assert "prefix_reuse.enabled" not in export(config_of(tiers), target, version).warned_knobs()


def test_a_tier_with_prefix_reuse_off_is_written_as_asked_where_the_engine_can():
    config = config_of({**HOST, "prefix_reuse.enabled": False})
    vllm = yaml.safe_load(export(config, "vllm").text)
    assert vllm["no-enable-prefix-caching"] is True and vllm["kv-offloading-size"] == 8.0
    kv = yaml.safe_load(export(config, "trtllm").text)["kv_cache_config"]
    assert kv["enable_block_reuse"] is False and kv["host_cache_size"] == 8 * GIB
    sglang = yaml.safe_load(export(config, "sglang").text)  # HiCache needs the radix cache: it stays on
    assert "disable-radix-cache" not in sglang and sglang["enable-hierarchical-cache"] is True


def test_sglang_chunk_size_is_a_batch_budget_and_warned():
    """SGLang's --chunked-prefill-size budgets a step's whole prefill batch; skistune's chunk_size caps one
    sequence: the mapping stays, with a warning, unless the cap equals the step budget (then both agree)."""
    result = export(config_of({"batching.chunk_size": 512, "batching.max_num_batched_tokens": 2048}), "sglang")
    assert yaml.safe_load(result.text)["chunked-prefill-size"] == 512
    [warning] = result.warnings
    assert warning.knob == "batching.chunk_size"
    assert warning.written == "chunked-prefill-size 512 (for the whole prefill batch)"
    assert "not a cap per sequence" in warning.reason
    for knobs in ({"batching.chunk_size": 2048}, {"batching.chunked_prefill": False}):
        assert not export(config_of(knobs), "sglang").warnings


def test_chunk_sizes_of_the_sglang_search_space_and_its_baseline_export_to_sglang_as_tuned():
    """As `skistune optimize --target vllm`'s configs export to vLLM without warnings, those of --target sglang
    (its baseline, SGLang's own defaults, included) should deploy their chunk size as tuned (`--strict`)."""
    import optuna

    from skistune.optimize import sglang_baseline_config
    from skistune.searchspace import load_space, suggest_config

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = load_space("sglang")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    warned = []
    for _ in range(200):  # (every point a valid config: chunked prefill off under a budget below the base's
        trial = study.ask()  # chunk of 8192 had been none, and crashed a search in one of two)
        config = suggest_config(trial, space, sglang_baseline_config())
        warned += [w for w in export(config, "sglang").warnings if w.knob != "offload.host_kv_bytes"]
        study.tell(trial, 0.0)
    assert not warned  # (chunk size, and prefix reuse off with a host tier: HiCache needs the radix cache)
    assert not export(sglang_baseline_config(), "sglang").warnings


@pytest.mark.parametrize(("target", "version", "how"), [
    ("vllm", "0.11", "--calculate-kv-scales"),
    ("vllm", "main-002f10e0", "k_scale/v_scale from a calibrated checkpoint"),
    ("sglang", "main-001067ff", "--quantization-param-path"),
    ("trtllm", "post-pr12449", "from the checkpoint"),
])
def test_fp8_exports_note_that_quality_needs_calibrated_scales(target, version, how):
    expressible = {"batching.chunk_size": 2048}  # a chunk cap every engine expresses
    int8 = config_of({**expressible, "bitwidth.key_bits": 8, "bitwidth.value_bits": 8})
    result = export(int8, target, version, strict=True)  # a caveat, not a knob the engine cannot express
    [note] = [n for n in result.notes if "calibrated scales" in n]
    assert "int8 quantization in groups of 32" in note and how in note
    assert not any("calibrated scales" in n for n in export(config_of(expressible), target, version).notes)


def test_vllm_fp8_note_for_per_layer_fp8():
    result = export(config_of({"bitwidth.layer_bits": [[8, 8]] * 28 + [[16, 16]] * 2}), "vllm", "main-002f10e0")
    assert any("calibrated scales" in n for n in result.notes)


@pytest.mark.parametrize(("size", "written"), [(4, 8), (2, 1), (256, 128)])  # 4 is 2x from 8, 4x from 1
def test_vllm_011_block_size_rounds_by_ratio(size, written):
    result = export(config_of({"prefix_reuse.block_size": size}), "vllm", "0.11")
    assert yaml.safe_load(result.text)["block-size"] == written
    assert [(w.knob, w.written) for w in result.warnings] == [("prefix_reuse.block_size", f"block-size {written}")]


def test_vllm_block_size_ratio_ties_go_to_the_larger_size():
    from skistune.export import EXPORTERS, EngineVersion

    vllm = EXPORTERS["vllm"]
    old = vllm.version("0.11")
    two_sizes = EngineVersion("test", "test", {**old.facts, "block_sizes": (2, 8)})  # 4 is 2x from each
    result = vllm.export(config_of({"prefix_reuse.block_size": 4}), two_sizes, SMOLLM, "vllm.yaml")
    assert yaml.safe_load(result.text)["block-size"] == 8


@pytest.mark.parametrize("version", ["0.11", "main-002f10e0"])
def test_vllm_caps_max_num_seqs_at_the_token_budget(version):
    """vLLM's SchedulerConfig refuses max_num_batched_tokens (512) < max_num_seqs (1024): the export wrote both as
    tuned, so the file could not start vLLM, and --strict passed. The cap is written, and warned (the runtime
    kept more sequences resident than vLLM takes)."""
    config = config_of({"batching.max_num_seqs": 1024, "batching.max_num_batched_tokens": 512,
                        "batching.chunk_size": 512})
    result = export(config, "vllm", version)
    data = yaml.safe_load(result.text)
    assert data["max-num-seqs"] == 512 and data["max-num-batched-tokens"] == 512
    assert "--max-num-seqs 512 " in result.command
    [warning] = result.warnings
    assert (warning.knob, warning.value, warning.written) == ("batching.max_num_seqs", 1024,
                                                              "max-num-seqs 512 (the token budget)")
    assert "vLLM will not start with max_num_seqs above max_num_batched_tokens (512" in warning.reason
    with pytest.raises(ValueError, match=r"--strict: .*batching\.max_num_seqs=1024 \(would write max-num-seqs 512"):
        export(config, "vllm", version, strict=True)
    equal = export(config.with_knobs({"batching.max_num_seqs": 512}), "vllm", version, strict=True)
    assert yaml.safe_load(equal.text)["max-num-seqs"] == 512  # (at the budget: vLLM starts, nothing to warn)


@pytest.mark.parametrize(("target", "version"), [("sglang", "main-001067ff"), ("trtllm", "post-pr12449")])
def test_more_sequences_than_the_token_budget_is_vllms_check_only(target, version):
    """The reference gives SGLang and TensorRT-LLM no check between the running-request cap and the token
    budget: those exports write both as tuned."""
    config = config_of({"batching.max_num_seqs": 1024, "batching.max_num_batched_tokens": 512,
                        "batching.chunk_size": 512})
    data = yaml.safe_load(export(config, target, version, strict=True).text)
    assert data["max-running-requests" if target == "sglang" else "max_batch_size"] == 1024


TINY_PYRAMID = {"eviction.policy": "streaming", "eviction.budget_tokens": 8, "eviction.sink_tokens": 0,
                "eviction.recent_window": 0, "eviction.layer_schedule": "pyramid", "batching.chunk_size": 2048}


def test_trtllm_windows_are_at_least_one_token():
    """A pyramid over 8 tokens and llama-3-8b's 32 layers gives the last two layers a budget of 0 (the runtime
    keeps no past token there): the export wrote max_attention_window entries of 0 without a word."""
    config = config_of(TINY_PYRAMID)
    budgets = runtime_layer_budgets(config.eviction, 32, 8192)
    assert budgets[-2:] == [0, 0] and min(budgets[:-2]) >= 1  # (the case: what the runtime keeps)
    result = export(config, "trtllm", model="llama-3-8b")
    kv = yaml.safe_load(result.text)["kv_cache_config"]
    assert kv["max_attention_window"] == budgets[:-2] + [1, 1] and kv["sink_token_length"] == 0
    [warning] = result.warnings
    assert (warning.knob, warning.written) == ("eviction.layer_schedule", "max_attention_window 1 for layers 30-31")
    assert "a budget of 0 tokens" in warning.reason
    with pytest.raises(ValueError, match=r"--strict: .*eviction\.layer_schedule=pyramid"):
        export(config, "trtllm", model="llama-3-8b", strict=True)
    # the layers file says what the runtime keeps, 0 included
    assert [v["budget"] for v in yaml.safe_load(export(config, "layers", model="llama-3-8b").text).values()] == budgets


def test_trtllm_sinks_are_clipped_to_the_window_as_the_runtime_clips_them():
    """sink_tokens 1024 in a 100-token budget: the runtime keeps the first 100 tokens (it clips the recent
    window, then the sinks, to the budget); the export asked TensorRT-LLM for 1024 sinks in a 100-token window."""
    config = config_of({"eviction.policy": "streaming", "eviction.budget_tokens": 100, "eviction.sink_tokens": 1024,
                        "eviction.recent_window": 0, "batching.chunk_size": 2048})
    result = export(config, "trtllm")
    kv = yaml.safe_load(result.text)["kv_cache_config"]
    assert kv["max_attention_window"] == [100] and kv["sink_token_length"] == 100
    [warning] = result.warnings
    assert (warning.knob, warning.value, warning.written) == ("eviction.sink_tokens", 1024,
                                                              "sink_token_length 100 (the window)")
    assert "it kept the first 100 tokens" in warning.reason
    with pytest.raises(ValueError, match=r"--strict: .*eviction\.sink_tokens=1024"):
        export(config, "trtllm", strict=True)
    # a pyramid keeps the sinks in every layer: its sinks always fit, and are written as asked
    pyramid = config_of({"eviction.policy": "streaming", "eviction.budget_tokens": 100, "eviction.sink_tokens": 8,
                         "eviction.recent_window": 16, "eviction.layer_schedule": "pyramid",
                         "batching.chunk_size": 2048})
    kv = yaml.safe_load(export(pyramid, "trtllm", strict=True).text)["kv_cache_config"]
    assert kv["sink_token_length"] == 8 and min(kv["max_attention_window"]) >= 24


@pytest.mark.parametrize("version", ["0.11", "main-002f10e0"])
def test_vllm_baseline_writes_no_prefill_threshold_and_notes_the_pinned_values(version):
    """The baseline ("nothing to change", vLLM's defaults) exported --long-prefill-token-threshold 2048 where it
    means vLLM's 0 (no per-request cap), and pinned the batch caps vLLM chooses by GPU without saying so."""
    from skistune.optimize import baseline_config

    result = export(baseline_config(), "vllm", version, strict=True)
    data = yaml.safe_load(result.text)
    assert "long-prefill-token-threshold" not in data and "long-prefill-token-threshold" not in result.command
    assert data["enable-chunked-prefill"] is True
    [note] = [n for n in result.notes if "pin the tuned values" in n]
    assert note.startswith("--max-num-seqs 256, --max-num-batched-tokens 2048 and --gpu-memory-utilization 0.9 "
                           if version != "0.11" else "--max-num-seqs 256 and --max-num-batched-tokens 2048 ")
    assert "1024 and 8192 on H100/H200" in note
    assert ("a memory utilization of 0.92" in note) == (version != "0.11")  # (0.9 is 0.11's default)
    # a chunk below the budget caps one prompt's tokens a step: the threshold is the chunk
    below = config_of({"batching.chunk_size": 512, "batching.max_num_batched_tokens": 2048})
    assert yaml.safe_load(export(below, "vllm", version).text)["long-prefill-token-threshold"] == 512


def test_sglang_baseline_leaves_max_prefill_tokens_at_sglangs_default():
    """The SGLang baseline exported --max-prefill-tokens 8192, not SGLang's default 16384; with chunked prefill
    on and a chunk budget of 8192 a step prefills at most 8192 either way, so the flag is left out, and a note
    names the automatic values pinned."""
    from skistune.optimize import sglang_baseline_config

    result = export(sglang_baseline_config(), "sglang", strict=True)
    data = yaml.safe_load(result.text)
    assert "max-prefill-tokens" not in data and data["chunked-prefill-size"] == 8192
    [note] = [n for n in result.notes if "pin the tuned values" in n]
    assert note.startswith("--page-size 1, --max-running-requests 2048, --chunked-prefill-size 8192 and "
                           "--mem-fraction-static 0.9 pin the tuned values")
    assert any("--max-prefill-tokens is left at SGLang's default, 16384" in n for n in result.notes)


@pytest.mark.parametrize(("knobs", "written"), [
    ({"batching.chunk_size": 32768, "batching.max_num_batched_tokens": 32768}, 32768),  # above the default
    ({"batching.chunked_prefill": False, "batching.max_num_batched_tokens": 8192}, 8192),  # the only prefill cap
    ({"batching.chunk_size": 512, "batching.max_num_batched_tokens": 2048}, 2048),  # not the chunk budget
])
def test_sglang_keeps_max_prefill_tokens_where_the_default_would_differ(knobs, written):
    data = yaml.safe_load(export(config_of(knobs), "sglang").text)
    assert data["max-prefill-tokens"] == written


def test_lmcache_without_a_tier_warns_that_it_would_store_nothing():
    result = export(config_of({}), "lmcache")
    [warning] = result.warnings
    assert warning.knob == "offload.host_kv_bytes" and warning.related == ("offload.disk_kv_bytes",)
    assert "LMCache would store nothing" in warning.reason
    with pytest.raises(ValueError, match=r"--strict: .*offload\.host_kv_bytes=0"):
        export(config_of({}), "lmcache", strict=True)
    for tiers in (HOST, DISK):
        assert "offload.host_kv_bytes" not in export(config_of(tiers), "lmcache").warned_knobs()


def test_a_predicted_gain_that_rests_on_knobs_the_engine_cannot_take_is_said_not_to_carry_over(tmp_path):
    path = tmp_path / "tuned.yaml"
    path.write_text("bitwidth:\n  key_bits: 8\n  value_bits: 4\nprovenance:\n  baseline:\n    gain:\n"
                    "      capacity: 1.3\n")
    notes = export(path, "vllm").notes
    assert "predicted gain over the baseline (capacity x1.3, the file's provenance)" in notes[0]
    assert "skistune optimize --target vllm searches only what vLLM deploys" in notes[0]
    path.write_text("bitwidth:\n  key_bits: 8\n  value_bits: 8\nprovenance:\n  baseline:\n    gain:\n"
                    "      capacity: 1.3\n")  # (fp8 keys and values: vLLM takes them as tuned, no warning)
    assert not any("predicted gain" in n for n in export(path, "vllm").notes)
