"""`skistune evaluate --mode run`: a default run (2,000 chat requests) had served for hours behind a spinner with no
count. A run now shows requests done / total, the elapsed time and an ETA on a terminal, and says before it starts
how long the simulator predicts it takes."""
from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from skistune.cli import app  # (first: it imports the commands' modules)
import skistune.evaluate as ev  # noqa: I001
import skistune.evaluate_cli as cli
from skistune.config import KVConfig
from skistune.profile import load_profile
from skistune.runtime.request import Request
from skistune.workloads import load_workload

from test_evaluate_findings import PROFILE  # (the shipped CPU profile)

SHIPPED = load_profile(PROFILE, check_fingerprint=False)  # (measured on another CPU: no warning for it here)


def test_requests_done_counts_finished_and_rejected_requests_as_the_engine_serves_them():
    """The count read from another thread: queued requests neither waiting nor running, checked after every step
    against the records themselves (a rejected request is done on arrival)."""
    from skistune.simulator import build_engine

    engine, _ = build_engine(KVConfig(), ev.sim_target("smollm2-135m", SHIPPED))
    context = engine.max_context
    engine.add_request(Request("long", [1] * context, 8))  # rejected: prompt + output exceed the context
    for i, out in enumerate((2, 5, 9)):
        engine.add_request(Request(f"r{i}", [3 + i] * 40, out))
    truth = lambda: sum(r.finish_s is not None or r.rejected_reason is not None for r in engine.records)  # noqa: E731
    seen = [ev.requests_done(engine)]
    assert seen == [1] == [truth()]
    while engine.scheduler.has_work():
        engine.step()
        assert ev.requests_done(engine) == truth()
        seen.append(ev.requests_done(engine))
    assert seen[-1] == 4 and {2, 3} <= set(seen)  # (the outputs of 2, 5 and 9 tokens finish on different steps)


def test_the_eta_is_the_rate_so_far_never_before_the_last_arrival_and_the_prediction_before_any_finish():
    assert ev.run_eta_s(50, 100, 20.0, 0.0) == (20.0, False)  # 50 more at 2.5 s each
    assert ev.run_eta_s(50, 100, 20.0, 100.0) == (80.0, False)  # the last request arrives in 80 s
    assert ev.run_eta_s(0, 100, 20.0, 100.0, predicted_s=300.0) == (280.0, False)
    assert ev.run_eta_s(0, 100, 20.0, 100.0) == (80.0, True)  # only a lower bound
    assert ev.run_eta_s(0, 100, 120.0, 100.0) == (None, True)
    assert ev.run_eta_s(100, 100, 5.0, 100.0) == (0.0, False)


def test_the_note_says_the_arrivals_span_and_the_predicted_run_time_before_a_run_starts():
    reqs = ev.workload_requests(load_workload("chat", requests=200), "smollm2-135m")
    predicted_s, name = ev.predicted_run_s(KVConfig(), reqs, "smollm2-135m", "cpu", SHIPPED)
    span_s = max(r.arrival_s for r in reqs)
    assert name == SHIPPED.name and predicted_s > span_s  # (chat overloads a 2-core CPU)
    assert predicted_s == ev.evaluate(KVConfig(), reqs, profile=SHIPPED).duration_s
    from skistune.display import format_duration

    long = ": fewer requests (--requests) or a lower rate (--rate-scale) make it shorter"
    assert cli.real_time_note(200, span_s, (predicted_s, name)) == (
        f"a run replays the arrivals in real time: these 200 requests arrive over {span_s:,.0f} s; the simulator "
        f"predicts the run takes about {format_duration(predicted_s)} (profile {name})"
        + (long if predicted_s >= cli.LONG_RUN_S else ""))
    assert cli.real_time_note(2000, 362.0, (20_600.0, name)).endswith(
        f"these 2000 requests arrive over 362 s; the simulator predicts the run takes about 5.7 h (profile {name}): "
        "fewer requests (--requests) or a lower rate (--rate-scale) make it shorter")
    assert [format_duration(s) for s in (45, 480, 20_600, 200_000)] == ["45 s", "8 min", "5.7 h", "2.3 days"]
    assert cli.real_time_note(3, 0.5, (2.0, name)) is None  # (a short run says nothing)
    assert cli.real_time_note(3, 12.0, None) == ("a run replays the arrivals in real time: these 3 requests arrive "
                                                 "over 12 s")


@pytest.mark.slow
def test_a_run_on_a_terminal_shows_requests_done_of_all_and_its_json_is_unchanged(tmp_path, monkeypatch):
    """A real run of 4 requests (SmolLM2, a few seconds) on a forced terminal: the progress counts every request
    done, through counts between 0 and 4, and the --json line has no extra key."""
    screen = io.StringIO()
    monkeypatch.setattr(cli, "err_console", Console(file=screen, force_terminal=True, width=120))  # (on stderr)
    monkeypatch.setattr(ev, "PROGRESS_INTERVAL_S", 0.02)
    calls: list[tuple[int, int]] = []
    original = ev.replay_with_progress
    monkeypatch.setattr(ev, "replay_with_progress", lambda rt, reqs, on_progress, interval_s=None: original(
        rt, reqs, lambda done, total: (calls.append((done, total)), on_progress(done, total)), interval_s))
    config = tmp_path / "kv.yaml"
    config.write_text("{}\n")
    r = CliRunner().invoke(app, ["evaluate", str(config), "--requests", "4", "--rate", "4", "--max-input", "32",
                                 "--max-output", "4", "--mode", "run", "--json"])
    assert r.exit_code == 0, r.output
    assert {total for _, total in calls} == {4} and calls[-1] == (4, 4)
    done = [d for d, _ in calls]
    assert done[0] == 0 and any(0 < d < 4 for d in done) and all(0 <= d <= 4 for d in done)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # (without the terminal's colour codes)
    assert "serving" in shown and "0/4 requests" in shown and "4/4 requests" in shown and "ETA" in shown
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["metrics"]["num_finished"] == 4 and not {"progress", "eta_s"} & set(out)
