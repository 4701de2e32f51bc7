"""The one definition of the knobs: validation, file round trips, dotted updates."""
import json

import pytest

from skistune.config import FAMILIES, KVConfig, knob_fields, load_config


def test_defaults_are_valid_and_cover_every_family():
    cfg = KVConfig()
    assert set(cfg.to_dict()) == set(FAMILIES) == {"eviction", "bitwidth", "offload", "prefetch", "batching",
                                                    "prefix_reuse"}
    assert cfg.bitwidth.key_bits == 16 and cfg.eviction.policy == "none" and cfg.prefix_reuse.enabled


def test_yaml_and_json_round_trip_byte_stably():
    cfg = KVConfig().with_knobs({"eviction.policy": "snapkv", "eviction.budget_fraction": 0.25,
                                 "bitwidth.layer_bits": [[4, 4], [8, 2]], "batching.policy": "edf",
                                 "offload.host_kv_bytes": 1 << 30})
    text = cfg.to_yaml()
    again = KVConfig.from_yaml(text)
    assert again == cfg and again.to_yaml() == text
    assert KVConfig.from_json(cfg.to_json()) == cfg and KVConfig.from_json(cfg.to_json()).to_json() == cfg.to_json()
    assert cfg.bitwidth.bits_for_layer(1) == (8, 2)


def test_partial_files_take_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("batching:\n  max_num_seqs: 8\n")
    cfg = load_config(str(p))
    assert cfg.batching.max_num_seqs == 8 and cfg.batching.chunk_size == 512
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"prefix_reuse": {"enabled": False}}))
    assert load_config(str(j)).prefix_reuse.enabled is False


def test_byte_knobs_take_sizes_as_people_write_them(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("offload:\n  host_kv_bytes: 8GiB\n  disk_kv_bytes: 500GB\n  device_kv_bytes: 256MiB\n")
    cfg = load_config(str(p))
    assert (cfg.offload.host_kv_bytes, cfg.offload.disk_kv_bytes, cfg.offload.device_kv_bytes) == (
        8 << 30, 500 * 10**9, 256 << 20)
    assert KVConfig().with_knobs({"offload.host_kv_bytes": "1GiB"}).offload.host_kv_bytes == 1 << 30
    assert "host_kv_bytes: 8589934592" in cfg.to_yaml()  # written as the exact integer


@pytest.mark.parametrize("text, size", [
    ("1.5GiB", 3 << 29), ("0.5KiB", 512), ("0.3KB", 300), ("2.50MB", 2_500_000), ("100TiB", 100 << 40),
    ("1.001KB", 1001), ("8.2MB", 8_200_000), ("0.0B", 0), ("17179869184", 1 << 34),
])
def test_fractional_sizes_that_come_out_whole_are_exact(text, size):
    # exact arithmetic: in floats 1.001 * 1000 is 1000.9999999999999, truncated to 1000 bytes
    assert KVConfig().with_knobs({"offload.host_kv_bytes": text}).offload.host_kv_bytes == size


@pytest.mark.parametrize("text", ["0.5B", "1.5B", "1.0001KiB", "0.0001KB", "0.5"])
def test_a_size_that_is_not_whole_bytes_is_refused_not_truncated(tmp_path, text):
    """0.5B was read as 0 (the tier silently off) and 1.5B as 1, while a float byte count 1.5 is refused."""
    p = tmp_path / "c.yaml"
    p.write_text(f"offload:\n  host_kv_bytes: '{text}'\n")
    with pytest.raises(ValueError) as err:
        load_config(str(p))
    assert str(err.value) == f"{p}: offload.host_kv_bytes: '{text}' is not a whole number of bytes"


def test_effective_reads_per_layer_bits_as_the_bits_each_layer_gets():
    """Per-layer bits override the uniform ones on every layer: 8-bit keys under 16/16 on every layer serve as
    16-bit KV (and are lossless), one pair on every layer is those uniform bits, and under bits that differ
    by layer the uniform ones do nothing (printed beside them, they had contradicted each other)."""
    from skistune.objectives import structural_changes

    lossless = KVConfig().with_knobs({"bitwidth.key_bits": 8, "bitwidth.layer_bits": [[16, 16]] * 30})
    assert lossless.effective() == KVConfig() and structural_changes(lossless) == []
    uniform = KVConfig().with_knobs({"bitwidth.layer_bits": [[4, 4]] * 30, "bitwidth.group_size": 64})
    assert uniform.effective() == KVConfig().with_knobs({"bitwidth.key_bits": 4, "bitwidth.value_bits": 4,
                                                          "bitwidth.group_size": 64})
    mixed = KVConfig().with_knobs({"bitwidth.key_bits": 8, "bitwidth.layer_bits": [[4, 4], [8, 8]] * 15})
    assert mixed.effective() == mixed.with_knobs({"bitwidth.key_bits": 16})
    assert structural_changes(mixed) == ["bitwidth.layer_bits"]


@pytest.mark.parametrize("updates, message", [
    ({"offload.host_kv_bytes": "lots"}, "offload.host_kv_bytes: 'lots' is not a byte size"),
    ({"batching.max_num_seqs": "8GiB"}, "batching.max_num_seqs: '8GiB' is not a number"),
    ({"bitwidth.key_bits": 3}, "bitwidth.key_bits: 3 is not one of 16, 8, 4, 2"),
    ({"batching.max_num_seqs": 0}, "batching.max_num_seqs: 0 is outside [1, 65536]"),
    ({"batching.chunked_prefill": "yes"}, "batching.chunked_prefill: 'yes' is not a boolean"),
    ({"prefetch.depth": 2.5}, "prefetch.depth: 2.5 is not an integer"),
    ({"eviction.policy": "h2o"}, "policy 'h2o' needs exactly one of budget_tokens or budget_fraction"),
    ({"eviction.budget_tokens": 64}, "a budget needs a policy other than 'none'"),
    ({"eviction.policy": "lru"}, "eviction.policy: 'lru' is not one of none, streaming, h2o, snapkv, tova"),
    ({"eviction.budget_fraction": 1.5, "eviction.policy": "h2o"}, "eviction.budget_fraction: 1.5 is outside"),
    ({"bitwidth.layer_bits": [[4, 3]]}, "bitwidth.layer_bits[0]: [4, 3] is not a [key_bits, value_bits] pair"),
    ({"batching.chunk_size": 4096}, "batching.chunk_size: 4096 exceeds batching.max_num_batched_tokens"),
    ({"offload.device_kv_bytes": None, "offload.host_kv_bytes": -1}, "offload.host_kv_bytes: -1 is outside"),
    ({"batching.nonsense": 1}, "batching.nonsense: unknown knob"),
    ({"nonsense": 1}, "nonsense: not a knob"),
])
def test_invalid_values_name_the_field_value_and_range(updates, message):
    with pytest.raises(ValueError) as err:
        KVConfig().with_knobs(updates)
    assert message in str(err.value)


def test_bad_files_name_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("batching: [1, 2\n")
    with pytest.raises(ValueError, match="bad.yaml: config: not valid YAML"):
        load_config(str(p))
    p.write_text("eviction: 3\n")
    with pytest.raises(ValueError, match="bad.yaml: eviction: expected a mapping"):
        load_config(str(p))
    # a family (or a knob) given twice: PyYAML kept the last, and the first one's knobs vanished silently
    p.write_text("batching:\n  max_num_seqs: 8\nprefix_reuse:\n  enabled: false\nbatching:\n  chunk_size: 64\n")
    with pytest.raises(ValueError, match=r"bad.yaml: config: not valid YAML \(duplicate key 'batching' \(first at "
                                         r"line 1\) at line 5, column 1\)"):
        load_config(str(p))
    p.write_text("batching:\n  max_num_seqs: 8\n  max_num_seqs: 16\n")
    with pytest.raises(ValueError, match=r"duplicate key 'max_num_seqs' \(first at line 2\) at line 3"):
        load_config(str(p))
    p.write_text("base: &b {max_num_seqs: 8}\nbatching:\n  <<: *b\n  chunk_size: 64\n")  # merged keys are no repeat
    with pytest.raises(ValueError, match="base: unknown knob family"):
        load_config(str(p))
    with pytest.raises(ValueError, match="missing.yaml: cannot read config"):
        load_config(str(tmp_path / "missing.yaml"))


def test_every_knob_documents_itself():
    fields = knob_fields()
    assert "eviction.budget_fraction" in fields and "batching.preemption" in fields
    for name, f in fields.items():
        assert f.metadata["help"], name
        assert f.metadata["choices"] is not None or f.metadata["low"] is not None or name == "bitwidth.layer_bits", name


def test_effective_sets_knobs_that_do_nothing_to_their_defaults():
    """A prefetch depth with prefetch off, a write policy with no lower tier, eviction details with no eviction,
    quantization groups at 16 bits: configs that serve alike compare equal through `effective`."""
    inert = KVConfig().with_knobs({"prefetch.depth": 8, "offload.write_policy": "write_through",
                                   "eviction.sink_tokens": 16, "bitwidth.group_size": 64})
    assert inert != KVConfig() and inert.effective() == KVConfig().effective() == KVConfig()
    live = KVConfig().with_knobs({"prefetch.enabled": True, "prefetch.depth": 8, "offload.host_kv_bytes": 1 << 30,
                                  "offload.write_policy": "write_through", "bitwidth.key_bits": 4,
                                  "bitwidth.group_size": 64})
    assert live.effective() == live


@pytest.mark.parametrize("updates, message", [
    # integer knobs, nullable ones included (their default is None: the declared type says int)
    ({"eviction.policy": "h2o", "eviction.budget_tokens": 10.5}, "eviction.budget_tokens: 10.5 is not an integer"),
    ({"eviction.policy": "h2o", "eviction.budget_tokens": True}, "eviction.budget_tokens: True is not a number"),
    ({"batching.max_num_seqs": 8.0}, "batching.max_num_seqs: 8.0 is not an integer"),
    ({"offload.device_kv_bytes": 1e8 + 0.5}, "offload.device_kv_bytes: 100000000.5 is not an integer"),
    # choices compare type-strictly: 4.0 == 4 and True == 1 in Python
    ({"bitwidth.key_bits": 4.0}, "bitwidth.key_bits: 4.0 is not an integer (one of 16, 8, 4, 2)"),
    ({"prefix_reuse.block_size": True}, "prefix_reuse.block_size: True is not an integer (one of 1, 2, 4"),
    ({"bitwidth.layer_bits": [[4.0, 4]]}, "bitwidth.layer_bits[0]: [4.0, 4] is not a [key_bits, value_bits] pair"),
    ({"eviction.policy": 3}, "eviction.policy: 3 is not a string (one of none, streaming"),
    # float knobs: NaN compares False with every bound, inf is past the high one
    ({"eviction.policy": "h2o", "eviction.budget_fraction": float("nan")},
     "eviction.budget_fraction: nan is outside [0.01, 1.0]"),
    ({"offload.device_memory_fraction": float("inf")}, "offload.device_memory_fraction: inf is outside [0.01, 1.0]"),
    ({"offload.device_memory_fraction": "0.5"}, "offload.device_memory_fraction: '0.5' is not a number"),
])
def test_wrong_types_and_non_finite_values_are_rejected_naming_the_field(updates, message):
    with pytest.raises(ValueError) as err:
        KVConfig().with_knobs(updates)
    assert message in str(err.value)


def test_a_whole_float_byte_count_is_a_byte_count_and_ints_are_fine_floats():
    # JSON has one number type: 1e8 arrives as a float; byte sizes as text are converted to ints likewise
    cfg = KVConfig.from_json('{"offload": {"device_kv_bytes": 1e8, "host_kv_bytes": 2.0}}')
    assert cfg.offload.device_kv_bytes == 10**8 and type(cfg.offload.device_kv_bytes) is int
    assert cfg.offload.host_kv_bytes == 2 and type(cfg.offload.host_kv_bytes) is int
    assert KVConfig().with_knobs({"offload.device_memory_fraction": 1}).offload.device_memory_fraction == 1


def test_yaml_nan_and_float_tokens_fail_through_the_cli_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from skistune.cli import app

    for text, message in (("eviction:\n  policy: h2o\n  budget_tokens: 10.5\n", "10.5 is not an integer"),
                          ("eviction:\n  policy: h2o\n  budget_fraction: .nan\n", "budget_fraction: nan is outside"),
                          ("bitwidth:\n  key_bits: 4.0\n", "key_bits: 4.0 is not an integer")):
        path = tmp_path / "kv.yaml"
        path.write_text(text)
        r = CliRunner().invoke(app, ["evaluate", str(path), "--requests", "2"])
        assert r.exit_code == 2 and message in r.output and r.output.startswith("error:")
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_chunk_size_is_checked_only_with_chunked_prefill_and_a_default_one_says_so(tmp_path):
    """A tester's `{chunked_prefill: false, max_num_batched_tokens: 64}` was refused over the default chunk size
    512, which nothing reads with chunked prefill off (the scheduler computes whole prompts)."""
    p = tmp_path / "c.yaml"
    p.write_text("batching:\n  chunked_prefill: false\n  max_num_batched_tokens: 64\n")
    assert load_config(str(p)).batching.chunk_size == 512
    p.write_text("batching:\n  max_num_batched_tokens: 64\n")
    with pytest.raises(ValueError) as err:
        load_config(str(p))
    assert str(err.value) == (f"{p}: batching.chunk_size: 512 (the default) exceeds batching.max_num_batched_tokens "
                              "(64); set batching.chunk_size to at most 64")
    # turning chunked prefill on checks the chunk size it then uses
    off = KVConfig().with_knobs({"batching.chunked_prefill": False, "batching.max_num_batched_tokens": 64})
    with pytest.raises(ValueError, match="512 \\(the default\\) exceeds"):
        off.with_knobs({"batching.chunked_prefill": True})


@pytest.mark.parametrize("text, size", [("1e9", 10**9), ("2.5e3", 2500), ("1E+3", 1000), ("10e-1", 1),
                                        (" 1e9 ", 10**9)])
def test_a_plain_number_in_scientific_notation_is_a_byte_size(tmp_path, text, size):
    """PyYAML reads 1e9 (no dot) as the string '1e9', while 1.0e9 is a float and was accepted."""
    p = tmp_path / "c.yaml"
    p.write_text(f"offload:\n  host_kv_bytes: {text}\n" if text.strip() == text else
                 f"offload:\n  host_kv_bytes: '{text}'\n")
    assert load_config(str(p)).offload.host_kv_bytes == size


@pytest.mark.parametrize("text, message", [
    ("1.5e0", "'1.5e0' is not a whole number of bytes"), ("1e-3", "'1e-3' is not a whole number of bytes"),
    ("1e3MiB", "'1e3MiB' is not a byte size"), ("1e", "'1e' is not a byte size"),
    ("1e999999999", "'1e999999999' is not a byte size"),  # refused at once, not computed
])
def test_scientific_notation_that_is_not_whole_bytes_is_refused(text, message):
    with pytest.raises(ValueError) as err:
        KVConfig().with_knobs({"offload.host_kv_bytes": text})
    assert str(err.value).startswith(f"offload.host_kv_bytes: {message}")


def test_the_constructor_takes_a_family_as_a_mapping_validated_like_a_file():
    """`KVConfig(batching={"max_num_seqs": 4})` failed with an AttributeError about a dict."""
    cfg = KVConfig(batching={"max_num_seqs": 4}, offload={"host_kv_bytes": "1GiB"})
    assert cfg == KVConfig().with_knobs({"batching.max_num_seqs": 4, "offload.host_kv_bytes": 1 << 30})
    assert KVConfig.from_yaml(cfg.to_yaml()) == cfg
    with pytest.raises(ValueError, match="batching.nope: unknown knob"):
        KVConfig(batching={"nope": 1})
    with pytest.raises(ValueError, match="batching.chunk_size: 4096 exceeds"):
        KVConfig(batching={"chunk_size": 4096})
    with pytest.raises(TypeError, match="^batching: expected a BatchingConfig or a mapping of knobs, got int$"):
        KVConfig(batching=5)


def test_per_layer_bits_are_written_as_runs_in_messages():
    from skistune.config import layer_bits_text

    assert layer_bits_text([[4, 4]] * 12 + [[8, 8]] * 18) == "[4/4 x12, 8/8 x18]"
    assert layer_bits_text(((8, 4), (8, 4), (4, 4), (8, 4))) == "[8/4 x2, 4/4 x1, 8/4 x1]"  # runs, in layer order
    assert layer_bits_text(512) == 512 and layer_bits_text([]) == []  # any other value as it is


def test_a_number_yaml_reads_as_text_is_refused_with_what_to_write():
    import yaml

    data = yaml.safe_load("batching:\n  max_num_seqs: 1e3\noffload:\n  device_memory_fraction: 5e-1\n")
    with pytest.raises(ValueError, match=r"batching.max_num_seqs: '1e3' is not a number \(YAML reads 1e3 as text: "
                                         r"write 1000\)"):
        KVConfig.from_dict(data)
    with pytest.raises(ValueError, match=r"'5e-1' is not a number \(YAML reads 5e-1 as text: write 0.5\)"):
        KVConfig.from_dict({"offload": {"device_memory_fraction": "5e-1"}})
    with pytest.raises(ValueError, match=r"'many' is not a number$"):
        KVConfig.from_dict({"batching": {"max_num_seqs": "many"}})


def test_byte_sizes_reach_the_top_of_their_range_in_its_own_unit():
    from skistune.config import format_bytes, parse_bytes

    assert parse_bytes("offload.disk_kv_bytes", "1PiB") == 1 << 50 and parse_bytes("x", "2PB") == 2 * 10**15
    assert format_bytes(1 << 50) == "1PiB" and format_bytes(3 << 40) == "3TiB"
    assert KVConfig.from_dict({"offload": {"disk_kv_bytes": "1PiB"}}).offload.disk_kv_bytes == 1 << 50


@pytest.mark.parametrize("name, text", [("kv.json", '{"batching": {"max_num_seqs": 64}}'),
                                        ("kv.yaml", "batching:\n  max_num_seqs: 64\n")])
def test_a_config_with_a_byte_order_mark_loads_in_either_format(tmp_path, name, text):
    """A tester's .json config with a UTF-8 BOM (as some Windows editors save) was refused; the same YAML loaded."""
    path = tmp_path / name
    path.write_bytes("\ufeff".encode() + text.encode())
    assert load_config(path).batching.max_num_seqs == 64
