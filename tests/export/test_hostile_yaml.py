"""Hostile config files (what a fuzzer sent): YAML nested thousands deep, alias bombs, an alias inside its own node,
JSON nested past the parser's recursion, and values megabytes long. Each is refused in one line naming the file
(`ValueError` from the API; exit 2 and no traceback from the CLI), quickly and in bounded memory; a message repeats
at most the first characters of a huge value."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from skistune.cli import app
from skistune.config import (MAX_ALIAS_NODES, MAX_YAML_DEPTH, KVConfig, _UniqueKeyLoader, load_config,
                             load_provenance, load_yaml, shown)


def _flow_lists(depth: int) -> str:
    return "batching: " + "[" * depth + "]" * depth + "\n"


def _block_mappings(depth: int) -> str:
    return "".join("  " * i + "a:\n" for i in range(depth))


def _bomb(where: str = "knob") -> str:
    """Nine anchors of nine aliases each: 9^9 values once expanded ("billion laughs")."""
    lines, prev = ["provenance:", "  a: &a [x, x, x, x, x, x, x, x, x]"], "a"
    for name in "bcdefghi":
        lines.append(f"  {name}: &{name} [{', '.join(['*' + prev] * 9)}]")
        prev = name
    if where == "knob":
        lines.append("batching: {max_num_seqs: *i}")
    return "\n".join(lines) + "\n"


HOSTILE = {
    "5000 nested flow lists": (_flow_lists(5000), rf"nested more than {MAX_YAML_DEPTH} levels at line 1, column"),
    "3000 nested block mappings": (_block_mappings(3000), rf"nested more than {MAX_YAML_DEPTH} levels at line "),
    "alias bomb under a knob": (_bomb("knob"), f"aliases expand to more than {MAX_ALIAS_NODES:,} values at line 7"),
    "alias bomb under provenance only": (_bomb("provenance"), f"aliases expand to more than {MAX_ALIAS_NODES:,}"),
    "alias inside its own node": ("batching: &a [*a]\n", "an alias inside the node it names"),
}


@pytest.mark.parametrize("text, error", HOSTILE.values(), ids=HOSTILE)
def test_hostile_yaml_is_one_value_error_naming_the_file(tmp_path: Path, text: str, error: str):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"^{path}: config: not valid YAML \({error}"):
        load_config(str(path))
    assert time.perf_counter() - start < 5  # (the bomb had run past 60 s, at 1.15 GB and rising)
    assert load_provenance(path) == {}  # (the provenance reader uses the same bounded loader)


def test_nesting_up_to_the_bound_loads_and_one_level_more_does_not():
    def nested(levels: int) -> str:  # provenance: {k: {k: ... {k: 1}}}, `levels` mappings in all
        return "provenance: " + "{k: " * (levels - 1) + "1" + "}" * (levels - 1) + "\n"

    data = load_yaml(nested(MAX_YAML_DEPTH - 1))  # (+ the document's own mapping: MAX_YAML_DEPTH levels)
    assert KVConfig.from_dict(data) == KVConfig()
    with pytest.raises(yaml.YAMLError, match=f"nested more than {MAX_YAML_DEPTH} levels"):
        load_yaml(nested(MAX_YAML_DEPTH))


def test_ordinary_anchors_and_merge_keys_still_load():
    text = ("base: &base {max_num_seqs: 8, policy: edf}\n"
            "batching:\n  <<: *base\n  max_num_seqs: 16\n")
    data = load_yaml(text)
    assert data["batching"] == {"max_num_seqs": 16, "policy": "edf"}
    cfg = KVConfig.from_yaml("bitwidth: {layer_bits: [&p [4, 8], *p, *p]}\n")
    assert cfg.bitwidth.layer_bits == ((4, 8),) * 3


def test_aliases_may_expand_to_the_bound_but_not_past_it():
    # one anchored list of 1,000 values, aliased: each alias adds the 1,001 nodes of the list
    anchor = "a: &a [" + ", ".join(["1"] * 1000) + "]\n"
    fits = MAX_ALIAS_NODES // 1001
    assert len(load_yaml(anchor + f"b: [{', '.join(['*a'] * fits)}]\n")["b"]) == fits
    with pytest.raises(yaml.YAMLError, match="aliases expand to more than"):
        load_yaml(anchor + f"b: [{', '.join(['*a'] * (fits + 1))}]\n")


def test_fast_and_python_loaders_read_the_shipped_files_alike():
    root = Path(__file__).resolve().parents[2]
    files = sorted(root.glob("searchspace/*.yaml")) + sorted(root.glob("tests/export/configs/*.yaml"))
    assert files
    for path in files:
        text = path.read_text()
        assert load_yaml(text) == yaml.load(text, Loader=_UniqueKeyLoader), path  # noqa: S506


def test_json_nested_past_the_parsers_recursion_is_one_value_error(tmp_path: Path):
    path = tmp_path / "deep.json"
    path.write_text('{"batching": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=rf"^{path}: config: not valid JSON \(nested more than {MAX_YAML_DEPTH}"):
        load_config(str(path))
    shallow = tmp_path / "shallow.json"  # nested less than the parser's limit, more than ours (_to_tuple recursed)
    shallow.write_text('{"batching": {"max_num_seqs": ' + "[" * 500 + "]" * 500 + "}}")
    with pytest.raises(ValueError, match="nested more than"):
        load_config(str(shallow))
    digits = tmp_path / "digits.json"
    digits.write_text('{"batching": {"max_num_seqs": ' + "9" * 5000 + "}}")
    with pytest.raises(ValueError, match=rf"^{digits}: config: not valid JSON \(a number of over 4,300 digits\)$"):
        load_config(str(digits))


@pytest.mark.parametrize("command", [["export", "{f}", "--to", "vllm"], ["evaluate", "{f}"],
                                     ["demo", "--config", "{f}"]])
@pytest.mark.parametrize("text", [_flow_lists(5000), _block_mappings(3000), _bomb()], ids=["flow", "block", "bomb"])
def test_cli_refuses_hostile_configs_in_one_line_with_exit_2(tmp_path: Path, command: list[str], text: str):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    args = [a.replace("{f}", str(path)) for a in command]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 2, r.output
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["exit_code"] == 2 and last["error"].startswith(f"{path}: config: not valid YAML (")
    assert r.stderr.strip() == f"error: {last['error']}"  # one line, no traceback


def test_shown_cuts_long_values_and_says_how_long_they_were():
    assert shown("fcfs") == "'fcfs'"
    assert shown("x" * (1 << 20)) == "'" + "x" * 79 + "…(1,048,576 characters)"
    assert shown((4,) * 1000).endswith("…(1,000 items)") and len(shown((4,) * 1000)) < 100
    assert shown(7 ** 200).endswith(f"…({len(str(7 ** 200)):,} characters)")


@pytest.mark.parametrize("text, start, end", [
    ("batching:\n  policy: " + "x" * (1 << 20) + "\n", "batching.policy: 'xxx",
     "…(1,048,576 characters) is not one of fcfs, prefix, edf"),
    ("bitwidth:\n  key_bits: [" + ", ".join(["4"] * 1000) + "]\n", "bitwidth.key_bits: (4, 4,",
     "…(1,000 items) is not an integer (one of 16, 8, 4, 2)"),
    ("batching:\n  ? " + "k" * 100_000 + "\n  : 1\n", "batching.kkk",
     "…(100,000 characters): unknown knob (known: chunk_size, chunked_prefill, max_num_batched_tokens, max_num_seqs, "
     "policy, preemption)"),
    ("offload:\n  host_kv_bytes: " + "9" * 5000 + "GiB\n", "offload.host_kv_bytes: '999",
     "…(5,003 characters) is not a byte size (a number of over 4,300 digits)"),
    ("offload:\n  host_kv_bytes: " + "9" * 4000 + "\n", "offload.host_kv_bytes: 999",
     "…(4,000 characters) is outside [0, 1125899906842624] bytes"),
    ("batching:\n  max_num_seqs: " + "9" * 5000 + "\n", "config: not valid YAML (a number of over 4,300 digits",
     "at line 2, column 17)"),
])
def test_error_lines_repeat_the_start_of_a_huge_value_only(tmp_path: Path, text: str, start: str, end: str):
    path = tmp_path / "big.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_config(str(path))
    message = str(info.value).removeprefix(f"{path}: ")
    assert message.startswith(start) and message.endswith(end), message[:300]
    assert len(message) < 250
    r = CliRunner().invoke(app, ["export", str(path), "--to", "vllm"])
    assert r.exit_code == 2 and len(r.stderr) < 400
