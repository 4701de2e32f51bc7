"""The program's output streams, as a tester found them: a reader that goes away (`| head -1`) or a full disk
had ended `optimize` and `report` before their files were written (exit 1, nothing said), a closed stdout had
ended every command with a traceback, COLUMNS=0 had printed nothing (errors included), and a character the
output's encoding lacks had ended `profile --show`. The work now goes on and its files are written; output lost
to anything but its reader going away is said on stderr and ends with exit 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from skistune.config import load_config

REPO = Path(__file__).resolve().parents[1]
PROFILE = str(REPO / "profiles" / "cpu-smollm2-135m.json")
OPTIMIZE = ["optimize", "--slo", "p99=200ms", "--profile", PROFILE, "--trials", "2", "--requests", "16",
            "--validate", "0"]


def env(**extra: str) -> dict[str, str]:
    out = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", **extra}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), out.get("PYTHONPATH", "")) if p)
    return out


def skistune(*args: str) -> list[str]:
    return [sys.executable, "-m", "skistune", *args]


def test_a_reader_that_goes_away_after_one_line_costs_optimize_nothing(tmp_path):
    p = subprocess.Popen(skistune(*OPTIMIZE, "--out", "t.yaml"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=tmp_path, env=env())
    p.stdout.readline()  # (`| head -1`: the first line, then the pipe closes)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    load_config(tmp_path / "t.yaml")  # (written whole, after the search: the tables come after it)


def test_stdout_on_a_full_disk_still_writes_the_tuned_file_and_says_the_output_was_lost(tmp_path):
    with open("/dev/full", "w") as full:
        r = subprocess.run(skistune(*OPTIMIZE, "--out", "t.yaml", "--json"), stdout=full, stderr=subprocess.PIPE,
                           cwd=tmp_path, env=env(), timeout=300, text=True)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("warning: the output could not be written (No space left on "
                                                 "device): what the command printed is lost; the files it wrote "
                                                 "are whole")
    assert "Traceback" not in r.stderr and (tmp_path / "t.yaml").is_file()


def test_a_closed_stdout_is_no_traceback(tmp_path):
    r = subprocess.run(["bash", "-c", 'exec "$@" >&-', "-", *skistune("workload", "show", "chat", "--requests", "8",
                                                                        "--json")],
                       capture_output=True, text=True, cwd=tmp_path, env=env(), timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_columns_zero_still_prints_the_error(tmp_path):
    r = subprocess.run(skistune("workload", "show", "nosuch"), capture_output=True, text=True, cwd=tmp_path,
                       env=env(COLUMNS="0"), timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error: workload 'nosuch': neither a preset"), r.stderr


def test_characters_the_encoding_lacks_are_replaced_not_fatal(tmp_path):
    r = subprocess.run(skistune("profile", "--show", PROFILE, "--json"), capture_output=True, cwd=tmp_path,
                       env=env(PYTHONIOENCODING="ascii"), timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert b"R?" in r.stdout or b"R^2" in r.stdout or b"R2" in r.stdout  # (the R-squared column, its ² replaced)
    json.loads(r.stdout.decode("ascii").strip().splitlines()[-1])


def test_a_narrow_terminal_wraps_figures_instead_of_cutting_them():
    """A tester's 40-column terminal showed latencies as "19…": every table's cells now wrap."""
    import io

    from rich.console import Console

    from skistune.display import Table

    table = Table(title="latency")
    table.add_column("figure")
    table.add_column("p99 (ms)", justify="right")
    table.add_row("TTFT", "19,033.2")
    screen = io.StringIO()
    Console(file=screen, width=16, no_color=True).print(table)
    text = screen.getvalue()
    assert "…" not in text
    cells = "".join(line.split("│")[2].strip() for line in text.splitlines() if line.count("│") == 3)
    assert cells == "19,033.2"  # (on as many lines as it takes, every character)
