"""A throw-away PostgreSQL server for tests and the reliability benchmark: ``initdb`` on a temporary
directory, ``pg_ctl start`` on a free loopback port, ``stop()`` removes it all. When run as root (initdb
refuses root) the server runs as ``nobody`` through runuser."""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

PG_USER = "skistune"
UNPRIVILEGED = "nobody"


def postgres_bin() -> Path | None:
    """The folder with initdb, pg_ctl and postgres: on PATH, else Debian's /usr/lib/postgresql/<v>/bin
    (Debian puts only wrappers on PATH), newest version first."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                    key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(debian[-1]).parent if debian else None


def unavailable_reason() -> str | None:
    """Why no server can be started here (None when one can)."""
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        return "psycopg2 is not installed (pip install -e '.[postgres]')"
    if postgres_bin() is None:
        return "PostgreSQL server binaries (initdb) not found on PATH or in /usr/lib/postgresql/*/bin"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: cannot start PostgreSQL as an unprivileged user"
    return None


def _as_server_user(cmd: list[str]) -> list[str]:
    return [shutil.which("runuser"), "-u", UNPRIVILEGED, "--", *cmd] if os.geteuid() == 0 else cmd


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """initdb with trust auth on loopback only, durability off (tests only); each `database()` call
    creates a fresh database and returns its URL."""

    def __init__(self) -> None:
        self.bin_dir = postgres_bin()
        # not under pytest's tmp_path: its folders are private to root, and the server may run as nobody
        self.root = Path(tempfile.mkdtemp(prefix="skistune-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.root, user=UNPRIVILEGED)
        self.data = self.root / "data"
        self.port = 0

    def _run(self, *args: str, timeout: float = 60) -> None:
        out = subprocess.run(_as_server_user([str(self.bin_dir / args[0]), *args[1:]]), capture_output=True,
                             check=False, text=True, timeout=timeout, cwd=self.root)
        if out.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({out.returncode}): {(out.stderr or out.stdout).strip()[-800:]}")

    def start(self) -> PostgresServer:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", PG_USER, "-E", "UTF8", "--no-sync")
        for attempt in range(3):  # the free port can be taken between choosing and binding it
            self.port = _free_port()
            options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                       "-c synchronous_commit=off -c full_page_writes=off")
            try:
                self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", options,
                          "-w", "-t", "60", "start", timeout=90)
                return self
            except RuntimeError:
                if attempt == 2:
                    raise
        return self

    def stop(self) -> None:
        """Stop the server (if it runs) and remove its directory."""
        try:
            if (self.data / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def database(self) -> str:
        import psycopg2

        name = f"t_{uuid.uuid4().hex[:12]}"
        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=PG_USER, dbname="postgres")
        try:
            conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE {name}")
        finally:
            conn.close()
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/{name}"
