"""The compiled CPU kernel's cache (`kernels/cpu_native.py`, `kernels/cache.py`): a damaged library is built
again before it is loaded (a truncated one had killed the process with SIGBUS when loaded; a 0-byte one
failed every run), concurrent builders wait on a lock for one build, an unwritable cache folder still gets
a kernel, and a relative XDG_CACHE_HOME is ignored as the XDG spec says."""
from __future__ import annotations

import fcntl
import hashlib
import os
import warnings
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skistune.kernels import cpu_native
from skistune.kernels.cache import lock_path, user_cache_dir

LOAD = "from skistune.kernels import cpu_native; print(cpu_native.available())"


def _load(cache: Path) -> subprocess.CompletedProcess:
    """Load the kernel in a child (a SIGBUS there must not take pytest with it)."""
    return subprocess.run([sys.executable, "-W", "always", "-c", LOAD], capture_output=True, text=True,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache)}, timeout=120)


def _built(cache: Path) -> Path:
    [so] = (cache / "skistune" / "kernels").glob("paged_decode_cpu-*.so")
    return so


def _intact(so: Path) -> bool:
    data = so.read_bytes()
    return so.with_name(so.name + ".sha256").read_text().split() == [hashlib.sha256(data).hexdigest(), str(len(data))]


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A cache with the kernel built in it once (the CI machine has gcc: never skipped)."""
    cache = tmp_path_factory.mktemp("kernel-cache")
    first = _load(cache)
    assert first.returncode == 0 and first.stdout.strip() == "True", first.stderr
    assert _intact(_built(cache))  # (its checksum recorded beside it)
    return cache


def _damaged(built_cache: Path, tmp_path: Path, damage) -> Path:
    """A copy of the built cache with its library damaged by ``damage(bytes) -> bytes``."""
    cache = tmp_path / "cache"
    folder = cache / "skistune" / "kernels"
    folder.mkdir(parents=True)
    so = _built(built_cache)
    (folder / so.name).write_bytes(damage(so.read_bytes()))
    sidecar = so.with_name(so.name + ".sha256")
    (folder / sidecar.name).write_text(sidecar.read_text())
    return cache


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[:20000], "20,000 bytes, {size:,} when built"),  # (the tester's SIGBUS: exit 135)
    (lambda b: b"", "0 bytes, {size:,} when built"),  # (had warned "unavailable" on every run, never rebuilt)
    (lambda b: b[:5000] + bytes([b[5000] ^ 0xFF]) + b[5001:], "its contents do not match the checksum recorded "
                                                              "when it was built"),
])
def test_a_damaged_library_is_built_again_before_it_is_loaded(built_cache, tmp_path, damage, why):
    size = _built(built_cache).stat().st_size
    cache = _damaged(built_cache, tmp_path, damage)
    so = _built(cache)
    done = _load(cache)
    assert done.returncode == 0 and done.stdout.strip() == "True", (done.returncode, done.stderr[-2000:])
    assert f"the cached CPU attention kernel {so} is damaged ({why.format(size=size)}); building it again" \
        in done.stderr
    assert so.stat().st_size == size and _intact(so)
    again = _load(cache)  # (rebuilt once: the next run loads it silently)
    assert again.stdout.strip() == "True" and "Warning" not in again.stderr


def test_a_library_without_its_checksum_is_built_again_without_calling_it_damaged(built_cache, tmp_path, monkeypatch):
    """One built before checksums were recorded (a tester's upgrade read "is damaged"), or by a builder killed
    between the two renames: built again, quietly."""
    cache = _damaged(built_cache, tmp_path, lambda b: b)
    so = _built(cache)
    so.with_name(so.name + ".sha256").unlink()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_native._build(cpu_native._compiler()) == so
    assert _intact(so)


def test_a_builder_waits_for_the_one_holding_the_lock_and_uses_its_build(built_cache, tmp_path):
    """Two first runs at once: the second waits on the lock file beside the library, then finds it built."""
    cache = tmp_path / "cache"
    so = cache / "skistune" / "kernels" / _built(built_cache).name
    so.parent.mkdir(parents=True)
    fd = os.open(lock_path(so), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # (as a builder that is compiling)
    try:
        child = subprocess.Popen([sys.executable, "-W", "always", "-c", LOAD], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env={**os.environ, "XDG_CACHE_HOME": str(cache)})
        time.sleep(4)  # (importing torch and hashing: well under this)
        assert child.poll() is None, child.communicate()  # waiting on the lock, not building beside it
        so.write_bytes(_built(built_cache).read_bytes())  # the holder's build, then its checksum
        so.with_name(so.name + ".sha256").write_text(_built(built_cache).with_name(so.name + ".sha256").read_text())
        mtime = so.stat().st_mtime_ns
    finally:
        os.close(fd)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0 and out.strip() == "True", err
    assert so.stat().st_mtime_ns == mtime and "Warning" not in err  # used, not built again


def test_concurrent_first_builds_leave_one_intact_library(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    children = [subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for _ in range(3)]
    for child in children:
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0 and out.strip() == "True", err
    folder = tmp_path / "skistune" / "kernels"
    assert _intact(_built(tmp_path))
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == \
        [_built(tmp_path).name, _built(tmp_path).name + ".sha256"]  # (no temporary left behind)
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [lock_path(_built(tmp_path)).name]


def test_an_unwritable_cache_folder_still_gets_a_kernel_with_one_warning(tmp_path):
    """XDG_CACHE_HOME naming a regular file (or a read-only mount): compiled for the run, said once."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    done = _load(not_a_folder)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert f"CPU attention kernel not cached: cannot write {not_a_folder}/skistune/kernels (Not a directory); " \
           "it is compiled for this run only" in done.stderr
    assert "unavailable" not in done.stderr


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert user_cache_dir("kernels") == Path.home() / ".cache" / "skistune" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert user_cache_dir("kernels") == Path.home() / ".cache" / "skistune" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_cache_dir("kernels") == tmp_path / "skistune" / "kernels"
