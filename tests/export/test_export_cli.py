"""`skistune export`: the file on stdout (or atomically at --out), --json on the last line, exit code 2 and
one line for bad input and for warnings under --strict."""
from __future__ import annotations

import json
import os
import shlex

import pytest
import yaml
from typer.testing import CliRunner

from export_cases import CONFIGS
from skistune.cli import app
from skistune.export import export

DEFAULT = str(CONFIGS / "default.yaml")
H2O_4BIT = str(CONFIGS / "h2o-4bit.yaml")
INT8 = str(CONFIGS / "int8-prefix-off.yaml")


def run(*args: str):
    return CliRunner().invoke(app, ["export", *args])


def one_line_error(result, text: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.strip().count("\n") == 0 and text in result.stderr


def test_prints_the_file_and_the_command():
    r = run(INT8, "--to", "vllm")
    assert r.exit_code == 0, r.output
    assert r.stdout == export(INT8, "vllm").text
    assert "command (with the file saved as vllm-config.yaml): vllm serve" in r.stderr  # (printed, not written)
    assert "--no-enable-prefix-caching" in r.stderr


def test_json_is_the_last_line():
    r = run(H2O_4BIT, "--to", "sglang", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["target"] == "sglang" and out["engine_version"] == "main-001067ff" and out["out"] is None
    assert out["command"].startswith("python -m sglang.launch_server")
    assert {w["knob"] for w in out["warnings"]} >= {"eviction.policy", "bitwidth.key_bits"}
    assert all(w["written"] and w["message"] for w in out["warnings"])


def test_warnings_name_knob_value_and_what_was_written():
    r = run(H2O_4BIT, "--to", "vllm", "--engine-version", "0.11")
    assert r.exit_code == 0
    assert "warning: eviction.policy=h2o:" in r.stderr and "wrote no eviction" in r.stderr
    assert "warning: bitwidth.key_bits=4:" in r.stderr and "wrote fp8" in r.stderr


def test_out_is_written_atomically(tmp_path):
    target = tmp_path / "vllm.yaml"
    target.write_text("old\n")
    r = run(INT8, "--to", "vllm", "--out", str(target), "--json")
    assert r.exit_code == 0, r.output
    assert target.read_text() == export(INT8, "vllm").text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm.yaml"]  # no temporary file left behind
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["out"] == str(target) and out["command"].startswith("vllm serve")
    assert r.stdout.strip().count("\n") == 0  # the file went to --out, not to stdout


def test_out_command_names_the_file_for_trtllm(tmp_path):
    target = tmp_path / "trt.yaml"
    r = run(DEFAULT, "--to", "trtllm", "--out", str(target), "--json")
    assert json.loads(r.stdout.strip().splitlines()[-1])["command"].endswith(f"--config {target}")


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "vllm.yaml"
    target.write_text("old\n")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    r = run(INT8, "--to", "vllm", "--out", str(target))
    one_line_error(r, "No space left on device")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["vllm.yaml"]


def test_strict_exits_2_and_writes_nothing(tmp_path):
    target = tmp_path / "vllm.yaml"
    r = run(H2O_4BIT, "--to", "vllm", "--strict", "--out", str(target))
    one_line_error(r, "--strict:")
    assert "eviction.policy=h2o" in r.stderr and not target.exists()
    assert run(INT8, "--to", "vllm", "--strict").exit_code == 0


@pytest.mark.parametrize(("args", "text"), [
    (["missing.yaml", "--to", "vllm"], "missing.yaml: cannot read config"),
    ([DEFAULT, "--to", "nginx"], "unknown export target (known: native, vllm, sglang, lmcache, trtllm, layers)"),
    ([DEFAULT, "--to", "vllm", "--engine-version", "0.4"], "versions supported are 0.11, main-002f10e0"),
    ([DEFAULT, "--to", "layers", "--model", "gpt-5"], "unknown preset"),
])
def test_bad_input_is_one_line_and_exit_2(args, text):
    one_line_error(run(*args), text)


def test_invalid_config_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "kv.yaml"
    bad.write_text("batching:\n  max_num_seqs: 0\n")
    one_line_error(run(str(bad), "--to", "vllm"), "batching.max_num_seqs: 0 is outside")
    one_line_error(run(DEFAULT, "--to", "vllm", "--out", str(tmp_path / "no" / "x.yaml")), "does not exist")


def test_layers_with_another_model():
    r = run(DEFAULT, "--to", "layers", "--model", "llama-3-8b")
    assert r.exit_code == 0 and r.stdout.count("nbits_key") == 32


@pytest.mark.parametrize("target", ["vllm", "trtllm"])
def test_out_that_is_a_directory_is_one_line_naming_out(tmp_path, target):
    folder = tmp_path / "somedir"
    folder.mkdir()
    r = run(DEFAULT, "--to", target, "--out", str(folder))
    one_line_error(r, f"--out {folder}: is a directory")
    assert ".tmp" not in r.stderr and list(tmp_path.iterdir()) == [folder] and not list(folder.iterdir())


def test_printed_command_quotes_the_out_path(tmp_path):
    target = tmp_path / "my cfg.yaml"
    r = run(DEFAULT, "--to", "trtllm", "--out", str(target), "--json")
    assert r.exit_code == 0, r.output
    command = json.loads(r.stdout.strip().splitlines()[-1])["command"]
    assert shlex.split(command)[-2:] == ["--config", str(target)]  # one argument, as pasted into a shell
    assert f"command: {command}" in " ".join(r.stderr.split())


@pytest.mark.parametrize("spelling", ["same", "dotted", "link"])
def test_out_that_is_the_input_config_is_refused(tmp_path, monkeypatch, spelling):
    """Writing the engine file over the config it came from would lose the config: refused before any work,
    however the path is spelled (relative, with ./, or through a link)."""
    config = tmp_path / "kv.yaml"
    config.write_text("batching: {chunked_prefill: false, max_num_batched_tokens: 2048}\n")
    monkeypatch.chdir(tmp_path)
    given = {"same": "kv.yaml", "dotted": f"{tmp_path}/./kv.yaml", "link": "link.yaml"}[spelling]
    if spelling == "link":
        (tmp_path / "link.yaml").symlink_to(config)
    r = run(str(config), "--to", "vllm", "--out", given)
    one_line_error(r, "is the input file")
    assert config.read_text() == "batching: {chunked_prefill: false, max_num_batched_tokens: 2048}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["kv.yaml"] + (["link.yaml"] if spelling == "link"
                                                                              else []))


def test_an_unwritable_out_names_the_path_given_not_the_temporary_file():
    r = run(DEFAULT, "--to", "vllm", "--out", "/proc/x.yaml")
    one_line_error(r, "/proc/x.yaml")  # (refused by the check before the export, or by the write)
    assert ".tmp" not in r.stderr


DISK = str(CONFIGS / "streaming-disk.yaml")  # host and disk tiers: vLLM reaches them through LMCache


def test_vllm_out_writes_the_lmcache_file_the_command_names(tmp_path):
    """The LMCache settings of a vLLM export were comments in its YAML: --out now writes the LMCache file
    beside it (the one --to lmcache writes), and the command points LMCACHE_CONFIG_FILE at it."""
    target = tmp_path / "vllm.yaml"
    r = run(DISK, "--to", "vllm", "--out", str(target), "--json")
    assert r.exit_code == 0, r.output
    companion = tmp_path / "vllm-lmcache.yaml"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm-lmcache.yaml", "vllm.yaml"]
    assert companion.read_text() == run(DISK, "--to", "lmcache").stdout
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["companions"] == [{"target": "lmcache", "engine_version": "main-000620e3", "file": str(companion),
                                  "written": True}]
    assert shlex.split(out["command"])[0] == f"LMCACHE_CONFIG_FILE={companion}"
    assert f"wrote {companion} (lmcache main-000620e3)" in r.stderr


def test_vllm_on_stdout_says_how_to_write_the_lmcache_file():
    r = run(DISK, "--to", "vllm", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["companions"] == [{"target": "lmcache", "engine_version": "main-000620e3",
                                  "file": "vllm-config-lmcache.yaml", "written": False}]
    assert "(with the files saved as vllm-config.yaml and vllm-config-lmcache.yaml)" in r.stderr
    assert (f"note: the command needs vllm-config-lmcache.yaml (lmcache): give --out to write both files, or run "
            f"skistune export {DISK} --to lmcache --out vllm-config-lmcache.yaml") in " ".join(r.stderr.split())


def printed_notes(stderr: str) -> list[str]:
    return [line[len("note: "):] for line in stderr.splitlines() if line.startswith("note: ")]


@pytest.mark.parametrize(("config", "target"), [(DISK, "vllm"), (DISK, "sglang"), (H2O_4BIT, "trtllm"),
                                                (DEFAULT, "lmcache")])
def test_every_note_printed_is_in_the_json_notes(config, target):
    """The vLLM export of a disk tier printed "the command needs vllm-config-lmcache.yaml ..." on standard
    error, while --json's notes lacked it (only companions[].written said false)."""
    r = run(config, "--to", target, "--json")
    assert r.exit_code == 0, r.output
    notes = json.loads(r.stdout.strip().splitlines()[-1])["notes"]
    assert printed_notes(r.stderr) == notes
    if target == "vllm":
        assert notes[0] == (f"the command needs vllm-config-lmcache.yaml (lmcache): give --out to write both files, "
                            f"or run skistune export {DISK} --to lmcache --out vllm-config-lmcache.yaml")


def test_with_out_the_companion_is_written_and_no_note_asks_for_it(tmp_path):
    r = run(DISK, "--to", "vllm", "--out", str(tmp_path / "vllm.yaml"), "--json")
    notes = json.loads(r.stdout.strip().splitlines()[-1])["notes"]
    assert printed_notes(r.stderr) == notes and not any(n.startswith("the command needs") for n in notes)


def test_an_lmcache_file_that_would_overwrite_the_input_is_refused(tmp_path):
    config = tmp_path / "vllm-lmcache.yaml"
    config.write_text(open(DISK).read())
    r = run(str(config), "--to", "vllm", "--out", str(tmp_path / "vllm.yaml"))
    one_line_error(r, "is the input file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm-lmcache.yaml"]


@pytest.mark.parametrize("args", [["missing.yaml", "--to", "vllm"], [DEFAULT, "--to", "nginx"]])
def test_bad_input_with_json_is_the_error_line_and_its_json(args):
    """Every command's convention (`cli_errors`): with --json too, bad input is one line on stderr, exit 2, and
    stdout holds only that line as JSON (the export's file text never starts)."""
    r = run(*args, "--json")
    one_line_error(r, "error: ")
    assert json.loads(r.stdout) == {"error": r.stderr.strip().removeprefix("error: "), "exit_code": 2}


@pytest.mark.parametrize("device, name, noted", [("cpu", "cpu-smollm2-135m-quick", True),
                                                 ("cuda", "cuda-llama-3-8b", False),
                                                 (None, "cpu-smollm2-135m", True)])  # (written before the device)
def test_a_config_tuned_on_a_cpu_profile_says_so_in_a_gpu_engines_export(tmp_path, device, name, noted):
    """A CPU-tuned file had exported gpu-memory-utilization 0.93 for a GPU without a word."""
    profile = {"name": name, **({"device": device} if device else {})}
    path = tmp_path / "tuned.yaml"
    path.write_text(f"batching: {{max_num_seqs: 64}}\nprovenance:\n  profile: {json.dumps(profile)}\n")
    said = [n for n in export(path, "vllm").notes if "measured on a CPU" in n]
    assert bool(said) == noted
    if noted:
        assert f"tuned with profile {name}, measured on a CPU" in said[0]
    assert not [n for n in export(path, "native").notes if "measured on a CPU" in n]  # (skistune's own file)


GIB = 1 << 30


def tuned_file(tmp_path, model: str):
    """A config as `skistune optimize --model MODEL` writes it: the knobs, then its provenance (`to_yaml`)."""
    from skistune.config import KVConfig

    config = KVConfig().with_knobs({"offload.device_kv_bytes": 40 * GIB, "offload.host_kv_bytes": 8 * GIB})
    path = tmp_path / "tuned.yaml"
    path.write_text(config.to_yaml(provenance={"model": model, "profile": {"name": f"cuda-{model}",
                                                                         "device": "cuda"}}))
    return str(path)


def test_without_model_the_export_is_for_the_model_the_file_was_tuned_for(tmp_path):
    """A config tuned for llama-3-8b had been exported for SmolLM2: its checkpoint, 30 layers, and byte pools
    turned into tokens at SmolLM2's 23040 bytes per token (num_cpu_blocks 23301, max_tokens 1864135)."""
    path = tuned_file(tmp_path, "llama-3-8b")
    r = run(path, "--to", "vllm", "--engine-version", "0.11")
    assert r.exit_code == 0, r.output
    assert "vllm serve meta-llama/Meta-Llama-3-8B-Instruct " in r.stderr and "tuned for" not in r.stderr
    assert json.loads(yaml.safe_load(r.stdout)["kv-transfer-config"])["kv_connector_extra_config"][
        "num_cpu_blocks"] == 4096  # 8 GiB / (131072 bytes per token x 16)
    assert yaml.safe_load(run(path, "--to", "sglang").stdout)["max-total-tokens"] == 327680  # 40 GiB / 131072
    assert yaml.safe_load(run(path, "--to", "trtllm").stdout)["kv_cache_config"]["max_tokens"] == 327680
    assert run(path, "--to", "layers").stdout.count("nbits_key") == 32
    assert "meta-llama/Meta-Llama-3-8B-Instruct" in export(path, "sglang").command  # (the Python API alike)


def test_another_model_than_the_recorded_one_is_exported_as_asked_with_a_one_line_warning(tmp_path):
    path = tuned_file(tmp_path, "llama-3-8b")
    r = run(path, "--to", "sglang", "--model", "smollm2-135m", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["command"].startswith("python -m sglang.launch_server --model-path HuggingFaceTB/SmolLM2-135M-Instruct ")
    [line] = [x for x in r.stderr.splitlines() if "tuned for" in x]
    assert line.startswith("warning: provenance.model=llama-3-8b: exported for model smollm2-135m (--model), but ")
    assert "tuned for llama-3-8b" in line and line.endswith("; wrote settings for smollm2-135m")
    assert out["warnings"][0]["knob"] == "provenance.model" and out["warnings"][0]["message"] == line[9:]
    assert "tuned for" not in run(path, "--to", "sglang", "--model", "llama-3-8b").stderr
    [warning, *_] = export(path, "layers", model="mistral-7b").warnings  # (the Python API alike)
    assert (warning.knob, warning.value) == ("provenance.model", "llama-3-8b")
    assert warning.written == "settings for mistral-7b"


@pytest.mark.parametrize("target", ["vllm", "layers"])
def test_another_model_than_the_recorded_one_is_in_the_json_warnings_and_fails_strict(tmp_path, target):
    """The warning went to standard error only (a Python warning): `--strict --json` in CI exited 0 with
    "warnings": [] while the byte pools and per-layer settings were sized for another model. docs/export.md
    promises --json carries every warning and --strict refuses every one."""
    path = tuned_file(tmp_path, "llama-3-8b")
    r = run(path, "--to", target, "--model", "smollm2-135m", "--strict", "--json")
    one_line_error(r, "--strict: ")
    assert "provenance.model=llama-3-8b (would write settings for smollm2-135m)" in r.stderr
    assert json.loads(r.stdout)["exit_code"] == 2
    same = run(path, "--to", target, "--model", "llama-3-8b", "--json")  # the recorded model: no such warning
    assert "provenance.model" not in {w["knob"] for w in json.loads(same.stdout.strip().splitlines()[-1])["warnings"]}


def test_a_recorded_model_that_is_no_preset_is_one_line_and_exit_2(tmp_path):
    one_line_error(run(tuned_file(tmp_path, "gpt-5"), "--to", "vllm"), "tuned for model 'gpt-5' (its provenance)")


def test_a_native_export_keeps_the_provenance_so_a_re_export_keeps_the_model(tmp_path):
    """`--to native` had dropped the provenance: re-exporting its file wrote SmolLM2's checkpoint for a config tuned
    for llama-3-8b, with no warning."""
    path = tuned_file(tmp_path, "llama-3-8b")
    native = tmp_path / "native.yaml"
    r = run(path, "--to", "native", "--out", str(native))
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(native.read_text())["provenance"] == yaml.safe_load(open(path))["provenance"]
    again = run(str(native), "--to", "sglang")
    assert again.exit_code == 0, again.output
    assert "--model-path meta-llama/Meta-Llama-3-8B-Instruct " in again.stderr
    assert run(str(native), "--to", "native").stdout == native.read_text()  # (idempotent)
    from skistune.config import KVConfig
    assert "provenance" not in export(KVConfig(), "native").text  # (a bare config has none to keep)
