"""Power sources (a RAPL tree, none at all) and the transfer measurements (block copies, real files)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skistune.profile import transfers
from skistune.profile.power import (
    RaplMeter,
    find_meter,
    measured_power,
    modeled_power,
    rapl_zones,
)
from skistune.profile.transfers import copy_blocks, disk_timings


def _zone(root: Path, name: str, energy_uj: int, range_uj: int = 1000_000_000) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{range_uj}\n")
    return zone


def test_rapl_packages_are_summed_and_their_wraparound_unwrapped(tmp_path):
    pkg0 = _zone(tmp_path, "intel-rapl:0", 999_000_000)
    _zone(tmp_path, "intel-rapl:0:0", 5)  # a sub-zone of package 0: counted in it already
    pkg1 = _zone(tmp_path, "intel-rapl:1", 10_000_000)
    assert [z.name for z in rapl_zones(tmp_path)] == ["intel-rapl:0", "intel-rapl:1"]
    meter = find_meter("cpu", rapl_root=tmp_path)
    assert isinstance(meter, RaplMeter) and meter.read_j() == 0.0
    (pkg0 / "energy_uj").write_text("1000000\n")  # wrapped past 1000 J: +2 J
    (pkg1 / "energy_uj").write_text("13000000\n")  # +3 J
    assert meter.read_j() == pytest.approx(5.0)


def test_unreadable_or_absent_rapl_means_modeled(tmp_path):
    assert find_meter("cpu", rapl_root=tmp_path / "absent") is None
    zone = _zone(tmp_path, "intel-rapl:0", 1)
    (zone / "energy_uj").write_text("not a number")
    assert find_meter("cpu", rapl_root=tmp_path) is None
    power = modeled_power("cpu", cpu_count=4)
    assert power.source == "modeled" and power.modeled and power.note.startswith("modeled")
    assert power.power_w(0.0) == pytest.approx(0.3 * 24) and power.power_w(1.0) == pytest.approx(24)
    assert power.power_w(2.0) == power.power_w(1.0) and power.energy_j(busy_s=2.0) == pytest.approx(48)


def test_measured_power_splits_idle_and_dynamic():
    class FakeMeter:
        source = "rapl"
        joules = 0.0

        def read_j(self):
            self.joules += 1.0  # one joule between reads: a 0.05 s idle window reads ~20 W
            return self.joules

    power = measured_power(FakeMeter(), idle_s=0.05, busy_w=50.0)
    assert power.source == "rapl" and not power.modeled
    assert 5 < power.idle_w <= 20.5 and power.power_w(1.0) == pytest.approx(50.0)


def test_block_copy_moves_the_right_blocks_in_bounded_batches(monkeypatch):
    monkeypatch.setattr(transfers, "STAGING_BYTES", 3 * 16 * 4)  # three 16-float blocks per batch
    src = torch.arange(10 * 16, dtype=torch.float32).reshape(10, 16)
    dst = torch.zeros(8, 16)
    src_ids, dst_ids = torch.tensor([9, 0, 4, 7, 2]), torch.tensor([1, 6, 3, 0, 5])
    copy_blocks(src, dst, src_ids, dst_ids)
    torch.testing.assert_close(dst[dst_ids], src[src_ids])
    assert dst[[2, 4, 7]].abs().sum() == 0


def test_disk_timings_use_real_files_in_the_given_directory(tmp_path):
    points = disk_timings(tmp_path, [4096, 1 << 20], warmup=0, repeats=2)
    assert [(p.kind, p.grid["bytes"]) for p in points] == [
        ("host_to_disk", 4096), ("disk_to_host", 4096), ("host_to_disk", 1 << 20), ("disk_to_host", 1 << 20)]
    assert all(p.timing.median_s > 0 and p.timing.repeats == 2 for p in points)
    assert list(tmp_path.iterdir()) == []  # the scratch file is removed


def test_disk_dir_that_is_not_a_directory_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        disk_timings(tmp_path / "nope", [4096], warmup=0, repeats=1)
