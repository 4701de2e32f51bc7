"""A preset's request count that this machine could not simulate is refused up front, in one line naming the most
that fit: `skistune optimize --requests 100000000` had drawn arrivals and lengths for minutes, its memory
growing, before anything failed. The memory available is patched here (nothing large is allocated)."""
from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

import skistune.host_memory as host_memory
import skistune.workloads.synthetic as synthetic
from skistune.workloads import PRESETS, get_preset, load_workload, synthesize

GB = 10**9


@pytest.fixture
def memory(monkeypatch):
    """Set the memory available to `bytes_` (the check reads it through `available_memory_bytes`)."""
    def set_to(bytes_: int | None) -> None:
        monkeypatch.setattr(synthetic, "available_memory_bytes", lambda: bytes_)
    return set_to


@pytest.fixture
def nothing_drawn(monkeypatch):
    """A refusal must come before the first draw (the arrivals are drawn first)."""
    def drawn(*args, **kwargs):
        raise AssertionError("arrivals were drawn before the count was checked")
    monkeypatch.setattr(synthetic, "renewal_arrivals", drawn)


def test_an_absurd_count_is_refused_in_one_line_naming_the_most_that_fit(memory, nothing_drawn):
    memory(16 * GB)
    each = synthetic.bytes_per_request(get_preset("chat"))
    with pytest.raises(ValueError) as refused:
        synthesize("chat", requests=100_000_000)
    fit = int(16 * GB // each)
    assert str(refused.value) == (
        f"--requests 100,000,000: chat requests take about {each / 1e3:.1f} KB each to simulate, "
        f"{100_000_000 * each / 1e9:,.1f} GB in all, more than the 16.0 GB of memory available here; at most "
        f"{fit:,} requests fit (in Python: requests=)")
    assert "\n" not in str(refused.value)
    assert 1_000_000 < fit < 2_000_000  # (10-20 KB a request, measured: 16 GB holds about 1.5 M chat requests)


def test_load_workload_refuses_it_the_same_way(memory, nothing_drawn):
    memory(16 * GB)
    with pytest.raises(ValueError) as direct:
        synthesize("agent", requests=10**8)
    with pytest.raises(ValueError) as loaded:
        load_workload("agent", requests=10**8)
    assert str(loaded.value) == str(direct.value)


def test_this_machine_refuses_a_count_no_machine_holds(nothing_drawn):
    """Unpatched: the real memory available (a petabyte of requests fits nowhere)."""
    with pytest.raises(ValueError, match=r"^--requests 100,000,000,000: chat requests take about 10\.\d KB each .* "
                                         r"at most [\d,]+ requests fit"):
        synthesize("chat", requests=10**11)


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_largest_count_that_fits_is_kept_and_one_more_is_refused(memory, name):
    memory(40_000_000)  # (40 MB: 2,000-4,000 requests, quick to draw)
    fit = synthetic.max_requests(get_preset(name))
    assert fit == int(40_000_000 // synthetic.bytes_per_request(get_preset(name)))
    assert len(synthesize(name, requests=fit)) == fit
    with pytest.raises(ValueError, match=f"at most {fit:,} requests fit"):
        synthesize(name, requests=fit + 1)


def test_smaller_blocks_make_longer_block_lists_and_fewer_requests_fit(memory, nothing_drawn):
    """A block id a block: 1-token blocks list 16 times the ids of 16-token ones (agent: 122 KB a request)."""
    memory(16 * GB)
    agent = get_preset("agent")
    assert synthetic.bytes_per_request(agent, 1) > 6 * synthetic.bytes_per_request(agent, 16)
    with pytest.raises(ValueError, match=r"agent requests take about 1\d\d\.\d KB each to simulate, 1-token blocks"):
        load_workload("agent", requests=500_000, block_tokens=1)


def test_unknown_memory_refuses_nothing(memory):
    memory(None)
    assert synthetic.max_requests(get_preset("chat")) is None
    assert len(synthesize("chat", requests=10)) == 10


@pytest.mark.parametrize("kwargs, error", [
    (dict(requests=2.5), "requests must be a whole number, got 2.5"),
    (dict(requests=True), "requests must be a whole number, got True"),
    (dict(block_tokens=0), "block_tokens must be a whole number >= 1, got 0"),  # (had been ZeroDivisionError)
])
def test_a_count_or_block_size_that_is_no_whole_number_is_refused_by_name(kwargs, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        synthesize("chat", **kwargs)


def test_the_available_memory_is_known_and_physical():
    """On Linux (CI): MemAvailable, or less within a cgroup's limit; never above the machine's memory."""
    import os

    available = synthetic.available_memory_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroups(tmp_path, own: str, files: dict[str, str]) -> int | None:
    """`_cgroup_room` over a made-up /proc/self/cgroup (``own``) and cgroup folder tree (``files``)."""
    (tmp_path / "fs").mkdir(parents=True)
    (tmp_path / "cgroup").write_text(own)
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return host_memory._cgroup_room(str(tmp_path / "cgroup"), str(tmp_path / "fs"))


def test_a_containers_memory_limit_bounds_the_memory_available(tmp_path):
    """A container's MemAvailable is its host's: the least room (limit - usage) on its cgroup's path counts."""
    v2 = {"memory.max": "max", "memory.current": "9000",
          "box/memory.max": str(4 * GB), "box/memory.current": str(1 * GB),
          "box/job/memory.max": "max", "box/job/memory.current": str(GB // 2)}
    assert cgroups(tmp_path / "a", "0::/box/job\n", v2) == 3 * GB
    assert cgroups(tmp_path / "b", "0::/\n", {"memory.max": "max", "memory.current": "5"}) is None
    v1 = {"memory/memory.limit_in_bytes": str(2**63 - 4096), "memory/memory.usage_in_bytes": "1",
          "memory/c/memory.limit_in_bytes": str(2 * GB), "memory/c/memory.usage_in_bytes": str(GB // 4)}
    assert cgroups(tmp_path / "c", "4:memory:/c\n1:cpu:/\n0::/\n", v1) == 2 * GB - GB // 4
    assert cgroups(tmp_path / "d", "garbage\n", {}) is None


def test_the_cli_refuses_it_with_exit_code_2_and_one_line(memory):
    from skistune.cli import app

    memory(16 * GB)
    r = CliRunner().invoke(app, ["workload", "show", "chat", "--requests", "100000000"])
    assert r.exit_code == 2, r.output
    assert re.fullmatch(r"error: --requests 100,000,000: chat requests take .* at most [\d,]+ requests fit "
                        r"\(in Python: requests=\)\n", r.stderr)


# ---- --jobs: each worker process simulates the search's requests itself ----
def test_workers_that_would_not_fit_together_are_refused_naming_how_many_fit(memory):
    each = 200_000 * synthetic.SIMULATED_BYTES_PER_REQUEST  # 2 GB a worker
    memory(5 * GB)
    synthetic.check_workers_fit(200_000, 2)  # 4 GB: fits
    synthetic.check_workers_fit(10**9, 1)  # one worker: the request count's own check decides (`synthesize`)
    with pytest.raises(ValueError) as refused:
        synthetic.check_workers_fit(200_000, 3)
    assert str(refused.value) == (
        f"--jobs 3: each worker process simulates the search's 200,000 requests, about {each / 1e9:.2f} GB each and "
        f"{3 * each / 1e9:.2f} GB in all, more than the 5.0 GB of memory available here; at most 2 fit (in Python: "
        "n_jobs=)")
    with pytest.raises(ValueError, match="not even one fits: give fewer requests"):
        synthetic.check_workers_fit(600_000, 2)
    memory(None)  # unknown: nothing refused
    synthetic.check_workers_fit(10**9, 64)


def test_optimize_refuses_too_many_workers_before_measuring_anything(memory, monkeypatch, tmp_path):
    from skistune.cli import app
    import skistune.optimize_cli as optimize_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(optimize_cli, "profile_or_measure",
                        lambda *a, **k: pytest.fail("the profile was read before the workers were checked"))
    n = 2_000
    memory(int(2.5 * n * synthetic.SIMULATED_BYTES_PER_REQUEST))  # two workers fit, three do not
    result = CliRunner().invoke(app, ["optimize", "--slo", "p99=200ms", "--requests", str(n), "--jobs", "3",
                                      "--json"])
    assert result.exit_code == 2, result.output
    assert "--jobs 3: each worker process simulates the search's 2,000 requests" in result.output
    assert "at most 2 fit" in result.output
    assert not list(tmp_path.iterdir())  # no study, no tuned file
