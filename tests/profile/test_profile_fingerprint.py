"""A profile measured on another fingerprint loads, with a warning that names what differs."""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

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
from skistune.profile.fingerprint import cpu_arch_from_cpuinfo


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


def test_diff_and_cache_key_ignore_only_the_date_and_the_memory():
    here = machine_fingerprint("cpu")
    later = Fingerprint(**{**here.to_dict(), "date": "2099-01-01T00:00:00+00:00", "host_memory_bytes": 1 << 40})
    other = Fingerprint(**{**here.to_dict(), "threads": here.threads + 1, "gpu_model": "H200"})
    assert fingerprint_diff(here, later) == [] and here.key() == later.key()
    assert fingerprint_diff(here, other) == [f"threads: {here.threads} -> {here.threads + 1}",
                                             "gpu_model: None -> H200"]
    assert here.key() != other.key()


def test_openmp_wait_counts_on_a_cpu_profile_that_recorded_it():
    """A CPU's steps ran x1.6 slower with sleeping OpenMP threads than spinning ones (an Intel host): a replay
    in a process that loaded torch before skistune (which sets the policy) had run the profile's steps x0.6."""
    here = Fingerprint(**{**machine_fingerprint("cpu").to_dict(), "openmp_wait": "passive"})
    spinning = Fingerprint(**{**here.to_dict(), "openmp_wait": "default"})
    [line] = fingerprint_diff(here, spinning)
    assert line.startswith("openmp_wait: passive -> default (") and "import skistune before torch" in line
    assert here.key() != spinning.key()
    older = Fingerprint(**{**here.to_dict(), "openmp_wait": None})  # (measured before it was recorded)
    assert fingerprint_diff(older, spinning) == []
    gpu = Fingerprint(**{**here.to_dict(), "gpu_model": "H200", "cuda_version": "12.8"})
    assert fingerprint_diff(gpu, Fingerprint(**{**gpu.to_dict(), "openmp_wait": "default"})) == []


def test_triton_counts_on_a_gpu_profile_only():
    """Triton's kernels run on GPUs only: installing it (the test extras do) made this machine's CPU quick
    profile read as measured elsewhere ('triton_version: None -> 3.9.0') and be measured again."""
    cpu = Fingerprint(**{**machine_fingerprint("cpu").to_dict(), "triton_version": None})
    with_triton = Fingerprint(**{**cpu.to_dict(), "triton_version": "3.9.0"})
    assert fingerprint_diff(cpu, with_triton) == [] and cpu.key() == with_triton.key()
    gpu = Fingerprint(**{**cpu.to_dict(), "gpu_model": "H200", "cuda_version": "12.8"})
    gpu_triton = Fingerprint(**{**gpu.to_dict(), "triton_version": "3.9.0"})
    assert fingerprint_diff(gpu, gpu_triton) == ["triton_version: None -> 3.9.0"] and gpu.key() != gpu_triton.key()


def test_fingerprint_describes_this_machine():
    import os

    import torch

    fp = machine_fingerprint("cpu")
    assert fp.cpu_count == os.cpu_count() and fp.threads == torch.get_num_threads()
    assert fp.torch_version == torch.__version__ and fp.gpu_model is None and fp.cuda_version is None
    assert fp.cpu_model and fp.skistune_version and fp.python_version


# /proc/cpuinfo excerpts: "model name" says "AMD EPYC" on both of the first two (masked on VMs)
AMD_ZEN_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 2
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni

processor\t: 1
vendor_id\t: AuthenticAMD
"""
AMD_ZEN4_AVX512 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse4_2 avx avx2 avx512f avx512dq avx512_bf16
"""
INTEL_SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 8
flags\t\t: fpu sse4_2 avx avx2 avx512f avx512bw avx512_vnni amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
stepping\t: 9
flags\t\t: fpu sse4_2
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm sve svebf16
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""


@pytest.mark.parametrize("text, arch", [
    (AMD_ZEN_AVX2, "AuthenticAMD family 23 model 1 stepping 2, avx2"),
    (AMD_ZEN4_AVX512, "AuthenticAMD family 25 model 17 stepping 1, avx512f"),
    (INTEL_SAPPHIRE_RAPIDS, "GenuineIntel family 6 model 143 stepping 8, avx512f amx_tile"),  # first processor
    (INTEL_SAPPHIRE_RAPIDS.replace(" avx2", "").replace(" avx512f", ""),
     "GenuineIntel family 6 model 143 stepping 8, avx amx_tile"),
    (GRAVITON3, "arm implementer 0x41 part 0xd40, sve asimd"),
    (GRAVITON3.replace(" sve svebf16", "").replace("0xd40", "0xd0c"), "arm implementer 0x41 part 0xd0c, asimd"),
    ("processor\t: 0\ncpu\t\t: POWER9\n", None),
    ("", None),
])
def test_cpu_arch_tells_generations_apart_where_the_model_name_does_not(text, arch):
    assert cpu_arch_from_cpuinfo(text) == arch


def test_a_profile_from_before_cpu_arch_loads_and_says_it_was_not_recorded(edited):
    here = machine_fingerprint("cpu")
    assert here.cpu_arch  # Linux x86 or Arm here: parsed from /proc/cpuinfo
    with pytest.warns(FingerprintWarning) as record:
        profile = load_profile(edited(lambda data: data["fingerprint"].pop("cpu_arch")))
    assert profile.fingerprint.cpu_arch is None
    # (measured here: only the field it predates differs, which is no evidence of another machine)
    assert "did not record cpu_arch, so whether it was measured on this machine is not known" in str(record[0].message)
    assert fingerprint_diff(profile.fingerprint, here) == [f"cpu_arch: not recorded -> {here.cpu_arch}"]


def test_every_shipped_fingerprint_still_loads():
    folder = Path(__file__).resolve().parents[2] / "profiles"
    shipped = [json.loads(path.read_text())["fingerprint"] for path in sorted(folder.glob("*.json"))
               if "fingerprint" in json.loads(path.read_text())]
    assert len(shipped) >= 2
    assert all(Fingerprint.from_dict(data).cpu_model == data["cpu_model"] for data in shipped)


def test_only_cpu_arch_may_be_missing_and_it_must_be_a_string():
    data = machine_fingerprint("cpu").to_dict()
    with pytest.raises(ValueError, match="fingerprint.cpu_arch: expected str"):
        Fingerprint.from_dict({**data, "cpu_arch": 23})
    del data["cpu_model"]
    with pytest.raises(ValueError, match="fingerprint.cpu_model: missing"):
        Fingerprint.from_dict(data)


def test_another_cpu_generation_gets_its_own_quick_profile():
    zen = Fingerprint(**{**machine_fingerprint("cpu").to_dict(), "cpu_model": "AMD EPYC",
                         "cpu_arch": cpu_arch_from_cpuinfo(AMD_ZEN_AVX2)})
    zen4 = Fingerprint(**{**zen.to_dict(), "cpu_arch": cpu_arch_from_cpuinfo(AMD_ZEN4_AVX512)})
    assert zen.key() != zen4.key()
    assert fingerprint_diff(zen4, zen) == ["cpu_arch: AuthenticAMD family 25 model 17 stepping 1, avx512f -> "
                                           "AuthenticAMD family 23 model 1 stepping 2, avx2"]


def test_the_machine_memory_is_recorded_and_profiles_from_before_it_load(edited):
    from skistune.profile.fingerprint import host_memory_bytes, recorded_memory

    here = machine_fingerprint("cpu")
    assert here.host_memory_bytes == host_memory_bytes() and here.host_memory_bytes > 1 << 28
    old = load_profile(edited(lambda data: data["fingerprint"].pop("host_memory_bytes", None)))
    assert old.fingerprint.host_memory_bytes is None
    assert recorded_memory(old.fingerprint, "cpu") == host_memory_bytes()  # this very machine: its own
    foreign = Fingerprint(**{**old.fingerprint.to_dict(), "cpu_model": "Imaginary CPU 9000"})
    assert recorded_memory(foreign, "cpu") is None  # another machine: unknown
    assert recorded_memory(Fingerprint(**{**foreign.to_dict(), "host_memory_bytes": 7 << 30}), "cpu") == 7 << 30


def test_a_profile_of_this_machine_from_before_cpu_arch_is_not_called_another_machines(tmp_path):
    """A profile measured here minutes earlier by a skistune that predates cpu_arch had been called "measured on a
    different machine or software (cpu_arch: not recorded -> ...)"."""
    from skistune.profile.profile import warn_if_elsewhere

    here = machine_fingerprint("cpu")
    profile = load_profile(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json",
                           check_fingerprint=False)
    older_here = replace(profile, fingerprint=replace(here, cpu_arch=None))
    with pytest.warns(FingerprintWarning) as record:
        warn_if_elsewhere(older_here, "old.json")
    [message] = [str(r.message) for r in record]
    assert message == ("old.json: measured by an earlier skistune that did not record cpu_arch, so whether it was "
                       "measured on this machine is not known; `skistune profile` measures this one")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_elsewhere(replace(profile, fingerprint=here), "same.json")  # (all recorded and equal: silent)
