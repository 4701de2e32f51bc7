"""A throw-away MariaDB (or MySQL) server for tests, as `pg_server` is for PostgreSQL: ``mariadb-install-db`` on a
temporary directory, ``mariadbd`` on a free loopback port with grant tables off (any local user connects as
root), ``stop()`` removes it all. Debian's package puts the server in /usr/sbin, often off PATH."""
from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

SBIN = ("/usr/sbin", "/usr/local/sbin", "/usr/bin")


def _find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)
        if found:
            return found
    return None


def unavailable_reason() -> str | None:
    """Why no server can be started here (None when one can)."""
    try:
        import pymysql  # noqa: F401
    except ImportError:
        return "pymysql is not installed (pip install -e '.[mysql]')"
    if _find("mariadbd", "mysqld") is None or _find("mariadb-install-db", "mysql_install_db") is None:
        return "MariaDB server binaries (mariadbd, mariadb-install-db) not found (apt-get install mariadb-server)"
    return None


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MariaDBServer:
    """One server for a test session; each `database()` call creates a fresh database and returns its URL."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="skistune-mariadb-"))
        self.data = self.root / "data"
        self.user = "root" if os.geteuid() == 0 else getpass.getuser()  # (mariadbd runs as root only if told)
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> MariaDBServer:
        out = subprocess.run([_find("mariadb-install-db", "mysql_install_db"), "--no-defaults", f"--datadir={self.data}",
                              f"--user={self.user}", "--auth-root-authentication-method=normal", "--skip-test-db"],
                             capture_output=True, text=True, timeout=120, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed ({out.returncode}): {(out.stderr or out.stdout)[-800:]}")
        for attempt in range(3):  # the free port can be taken between choosing and binding it
            self.port = _free_port()
            self.proc = subprocess.Popen(
                [_find("mariadbd", "mysqld"), "--no-defaults", f"--datadir={self.data}", f"--user={self.user}",
                 f"--port={self.port}", "--bind-address=127.0.0.1", f"--socket={self.root / 'sock'}",
                 f"--pid-file={self.root / 'pid'}", f"--log-error={self.root / 'error.log'}", "--skip-grant-tables",
                 "--innodb-buffer-pool-size=32M", "--innodb-flush-log-at-trx-commit=0", "--skip-log-bin"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._ready(timeout_s=60):
                return self
            self._kill()
        log = (self.root / "error.log").read_text(errors="replace")[-800:] if (self.root / "error.log").exists() else ""
        raise RuntimeError(f"mariadbd did not start: {log}")

    def _ready(self, timeout_s: float) -> bool:
        import pymysql

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                pymysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2).close()
                return True
            except pymysql.err.OperationalError:
                time.sleep(0.05)
        return False

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        try:
            self._kill()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def connect(self, database: str | None = None):
        import pymysql

        return pymysql.connect(host="127.0.0.1", port=self.port, user="root", database=database, autocommit=True)

    def database(self) -> tuple[str, str]:
        """A fresh database: its name and its storage URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE {name}")
        finally:
            conn.close()
        return name, f"mysql+pymysql://root@127.0.0.1:{self.port}/{name}"
