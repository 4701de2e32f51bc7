"""A prediction carries the profile's notes on how a tier's transfers were measured only when its config uses
that tier: a config without host or disk tiers was told where the profiler timed disk transfers."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.config import KVConfig
from skistune.profile import load_profile
from skistune.profile.profile import CPU_HOST_NOTE, PAGE_CACHE_NOTE, HardwareProfile, disk_note
from skistune.runtime.request import Request
from skistune.simulator import simulate, target_from_profile

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
CPU_PROFILE = PROFILES / "cpu-smollm2-135m.json"
TEMP_DISK_NOTE = ("disk-tier transfers were timed on a scratch file in a new temporary directory (the system's "
                  "default): a disk tier on another drive may be faster or slower (`skistune profile --disk-dir "
                  "DIR` times the drive the tier will use)")
HOST = {"offload": {"host_kv_bytes": 64 << 20}}
DISK = {"offload": {"host_kv_bytes": 64 << 20, "disk_kv_bytes": 256 << 20}}


@pytest.fixture(scope="module")
def cpu_profile() -> HardwareProfile:
    return load_profile(CPU_PROFILE, check_fingerprint=False)


def test_the_shipped_profiles_notes_are_read_apart_by_tier_with_the_disk_note_reworded(cpu_profile):
    """The shipped files keep every note in one `notes` list, as the profiler wrote them before."""
    assert cpu_profile.notes == ()
    assert cpu_profile.tier_notes == {"host": (CPU_HOST_NOTE,), "disk": (TEMP_DISK_NOTE,)}
    cuda = load_profile(PROFILES / "cuda-llama-3-8b.json", check_fingerprint=False)
    assert cuda.notes == ("random weights: timing only, generated text is meaningless",)
    assert cuda.tier_notes == {"disk": (TEMP_DISK_NOTE,)}
    assert cpu_profile.all_notes == (CPU_HOST_NOTE, TEMP_DISK_NOTE)


def test_a_legacy_disk_dir_and_page_cache_note_are_worded_as_the_profiler_words_them_now(cpu_profile):
    data = cpu_profile.to_dict()
    del data["tier_notes"]
    data["notes"] = ["random weights: x", "disk: /mnt/nvme", "disk reads may come from the page cache (no "
                     "posix_fadvise here)"]
    p = HardwareProfile.from_dict(data)
    assert p.notes == ("random weights: x",)
    assert p.tier_notes == {"disk": (disk_note("/mnt/nvme"), PAGE_CACHE_NOTE)}
    assert disk_note("/mnt/nvme").startswith("disk-tier transfers were timed on a scratch file in /mnt/nvme: ")


def test_tier_notes_round_trip_and_a_new_file_is_not_read_by_its_notes_text(cpu_profile):
    p = HardwareProfile.from_dict(json.loads(json.dumps(cpu_profile.to_dict())))
    assert (p.notes, p.tier_notes) == (cpu_profile.notes, cpu_profile.tier_notes)
    data = cpu_profile.to_dict()
    data["notes"] = ["disk: a general note that only looks like an old one"]
    data["tier_notes"] = {"disk": ["timed on /data"]}
    p = HardwareProfile.from_dict(data)
    assert p.notes == ("disk: a general note that only looks like an old one",)
    assert p.tier_notes == {"disk": ("timed on /data",)}
    data["tier_notes"] = {"gpu": []}
    with pytest.raises(ValueError, match="profile.tier_notes: expected an object of host/disk -> notes"):
        HardwareProfile.from_dict(data)


@pytest.mark.parametrize("config, expected", [
    ({}, ()),
    (HOST, (CPU_HOST_NOTE,)),
    (DISK, (CPU_HOST_NOTE, TEMP_DISK_NOTE)),  # (a disk tier's blocks cross device <-> host too)
])
def test_a_prediction_carries_the_notes_of_the_tiers_its_config_uses(cpu_profile, config, expected):
    requests = [Request(i, list(range(3, 67)), 4, arrival_s=0.1 * i) for i in range(4)]
    notes = simulate(KVConfig.from_dict(config), requests, target_from_profile(cpu_profile)).notes
    assert tuple(n for n in notes if n in cpu_profile.all_notes) == expected


def test_the_profiler_keeps_tier_notes_apart(monkeypatch):
    from skistune.profile import measure

    monkeypatch.setattr(measure, "page_cache_dropped", lambda: False)
    runtime = SimpleNamespace(notes=("random weights: x",), model=SimpleNamespace(device=SimpleNamespace(type="cpu")))
    assert measure._notes(runtime, Path("/mnt/nvme")) == {
        "notes": ("random weights: x",),
        "tier_notes": {"disk": (disk_note("/mnt/nvme"), PAGE_CACHE_NOTE), "host": (CPU_HOST_NOTE,)}}
    monkeypatch.setattr(measure, "page_cache_dropped", lambda: True)
    runtime.model.device.type = "cuda"
    assert measure._notes(runtime, None) == {"notes": ("random weights: x",), "tier_notes": {"disk": (TEMP_DISK_NOTE,)}}


def test_evaluate_prints_no_tier_note_for_a_config_without_tiers(tmp_path):
    out = {}
    for name, config in (("plain", "{}\n"), ("disk", "offload:\n  host_kv_bytes: 64MiB\n  disk_kv_bytes: 256MiB\n")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(config)
        r = CliRunner().invoke(app, ["evaluate", str(path), "--requests", "4", "--profile", str(CPU_PROFILE),
                                     "--json"])
        assert r.exit_code == 0, r.output
        out[name] = (" ".join(r.output.split()), json.loads(r.output.strip().splitlines()[-1]))
    text, data = out["plain"]
    # (the profile's own notes may stand: the speed it was measured at moved, `HardwareProfile.drift_note`)
    assert [n for n in data["metrics"]["notes"] if "moved while it was measured" not in n] == []
    assert "device is the CPU" not in text and "disk-tier" not in text
    text, data = out["disk"]
    # (a profile written before the timing of per-part copies and of the disk tier's block conversions says so)
    gaps = load_profile(CPU_PROFILE, check_fingerprint=False).transfer_gaps
    assert [n for n in data["metrics"]["notes"] if "tier transfer times rest on poor fits" not in n
            and "moved while it was measured" not in n] == [
        CPU_HOST_NOTE, *gaps.get("host", ()), TEMP_DISK_NOTE, *gaps.get("disk", ())]
    assert f"note {TEMP_DISK_NOTE}" in text


def test_a_gpu_profile_sizes_the_kv_pool_from_the_memory_its_weights_leave():
    """The runtime sizes the pool from the free memory once the weights are loaded (`torch.cuda.mem_get_info`);
    the simulator had taken the H200's whole memory, a pool 13.5 GiB too large for Llama-3-8B."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = load_profile(str(PROFILES / "cuda-llama-3-8b.json"))
    target = target_from_profile(profile)
    weights = target.spec.param_count() * 2  # bf16
    assert weights > 14 << 30  # (8.0 B parameters: 14.96 GiB)
    assert target.device_free_bytes == profile.fingerprint.gpu_memory_bytes - weights


def test_a_device_pool_larger_than_the_profiled_machine_can_hold_gets_a_note(cpu_profile):
    """A 64 GiB device pool on the 23 GiB CPU host (`--mode run` refuses it) was simulated without a word,
    while a host tier too large had its note."""
    import warnings

    from dataclasses import replace

    from skistune.problem import oversized_tier_notes

    host = replace(cpu_profile, fingerprint=replace(cpu_profile.fingerprint, host_memory_bytes=23 << 30))
    big = KVConfig().with_knobs({"offload.device_kv_bytes": 64 << 30})
    assert oversized_tier_notes(big, host, target_from_profile(host)) == [
        "offload.device_kv_bytes: 64GiB is more than the 23GiB the profiled machine can give its KV pool (its 23GiB of "
        "memory, where a CPU's KV pool lives): simulated as configured, but a replay there would not hold it"]
    assert oversized_tier_notes(KVConfig(), host, target_from_profile(host)) == []
    # memory not recorded, on another machine (on the one the profile was measured on, this one's is read)
    elsewhere = replace(cpu_profile, fingerprint=replace(cpu_profile.fingerprint, cpu_model="another CPU",
                                                          host_memory_bytes=None))
    assert oversized_tier_notes(big, elsewhere, target_from_profile(elsewhere)) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h200 = load_profile(str(PROFILES / "cuda-llama-3-8b.json"))
    target = target_from_profile(h200)
    assert oversized_tier_notes(big, h200, target) == []  # 64 GiB fits the H200's 124.9 GiB left by the weights
    huge = KVConfig().with_knobs({"offload.device_kv_bytes": 200 << 30})
    [note] = oversized_tier_notes(huge, h200, target)
    assert "(the GPU's memory less the model's weights)" in note
