"""One rule for units across `skistune optimize`'s options (a bare number is refused by --slo, --energy and
--max-queue alike, in one line that shows a unit), and SLO errors that name the mistake: a negative limit, an
unknown unit."""
import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.objectives import parse_energy, parse_max_queue
from skistune.slo import parse_slo

from test_optimize_cli import SMALL


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def one_line_error(r) -> str:
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


# 1. a bare --energy was J/token, a bare --max-queue seconds, while a bare --slo is refused
def test_a_bare_energy_budget_is_refused_with_an_example_unit():
    for text in ("0.5", "0.5/token"):
        with pytest.raises(ValueError) as err:
            parse_energy(text)
        assert str(err.value) == (f"energy {text!r}: the budget needs a unit: write 0.5J/token or 0.5mJ/token "
                                  "(units: J, mJ, uJ per token)")
    assert parse_energy("0.5J/token").limit_j_per_token == parse_energy("500mJ/token").limit_j_per_token == 0.5
    assert parse_energy("0.5j").limit_j_per_token == 0.5
    with pytest.raises(ValueError, match=r"^energy '-0.5J/token': the budget must be positive$"):
        parse_energy("-0.5J/token")


def test_a_bare_max_queue_is_refused_with_an_example_unit():
    with pytest.raises(ValueError) as err:
        parse_max_queue("5")
    assert str(err.value) == "--max-queue '5': the limit needs a unit: write 5s or 5ms (units: s, ms, us), or off"
    assert (parse_max_queue("5s"), parse_max_queue("500ms"), parse_max_queue("250us")) == (5.0, 0.5, 0.00025)
    assert parse_max_queue("off") is None
    for text, message in (("5sec", "unknown unit 'sec': write the limit in s, ms or us"),
                          ("0s", "must be a positive, finite time"), ("1e999s", "must be a positive, finite time"),
                          ("-5s", "write a positive time such as 5s or 500ms, or off")):
        with pytest.raises(ValueError, match=message):
            parse_max_queue(text)


def test_optimize_refuses_a_bare_energy_in_one_line_exit_2(here):
    r = invoke("optimize", "--slo", "p99=200ms", "--energy", "0.5", *SMALL)
    assert one_line_error(r) == ("error: energy '0.5': the budget needs a unit: write 0.5J/token or 0.5mJ/token "
                                 "(units: J, mJ, uJ per token)")
    assert not list(here.iterdir())  # nothing ran


def test_optimize_refuses_a_bare_max_queue_in_one_line_exit_2(here):
    # (needs optimize_cli.parse_max_queue to be objectives.parse_max_queue)
    r = invoke("optimize", "--slo", "p99=200ms", "--max-queue", "5", *SMALL)
    assert one_line_error(r) == ("error: --max-queue '5': the limit needs a unit: write 5s or 5ms "
                                 "(units: s, ms, us), or off")
    assert not list(here.iterdir())


# 2. -5ms, 200sec and 1h got only the generic "write METRIC:pXX<=VALUE" line
@pytest.mark.parametrize("text, message", [
    ("p99=-5ms", "SLO 'p99=-5ms': the limit must be a positive, finite time"),
    ("p99=-5", "SLO 'p99=-5': the limit must be a positive, finite time"),  # (not "write -5ms")
    ("p99=200sec", "SLO 'p99=200sec': unknown unit 'sec': write the limit in s, ms or us (e.g. p99=200ms)"),
    ("tbt:p99<=1h", "SLO 'tbt:p99<=1h': unknown unit 'h': write the limit in s, ms or us (e.g. p99=200ms)"),
    ("p99=200µs", "SLO 'p99=200µs': unknown unit 'µs': write the limit in s, ms or us (e.g. p99=200ms)"),
])
def test_slo_errors_name_the_mistake(text, message):
    with pytest.raises(ValueError) as err:
        parse_slo(text)
    assert str(err.value) == message


def test_slo_forms_that_parsed_still_parse():
    assert [str(parse_slo(t)) for t in ("p99=200ms", "ttft:p90<=1s", "p99=1e-3s", "max=250us", "p99.9=+2ms")] == [
        "tbt:p99<=200ms", "ttft:p90<=1000ms", "tbt:p99<=1ms", "tbt:max<=0.25ms", "tbt:p99.9<=2ms"]
    with pytest.raises(ValueError, match="write METRIC:pXX<=VALUE"):
        parse_slo("p99=[b]ms")


def test_optimize_names_an_unknown_slo_unit_in_one_line(here):
    r = invoke("optimize", "--slo", "p99=200sec", *SMALL)
    assert one_line_error(r) == ("error: SLO 'p99=200sec': unknown unit 'sec': write the limit in s, ms or us "
                                 "(e.g. p99=200ms)")


def test_the_api_takes_a_number_as_joules_per_token_and_text_with_its_unit():
    """A Python number has no unit to forget (``max_queue_s`` is seconds likewise); text does."""
    from skistune.problem import _parse_specs

    assert _parse_specs(None, 0.5, ())[1] == _parse_specs(None, "500mJ/token", ())[1]
    with pytest.raises(ValueError, match="needs a unit"):
        _parse_specs(None, "0.5", ())


def test_an_slo_on_a_run_with_no_finished_request_is_not_met():
    """Guards against an SLO whose percentile is NaN (no request finished, nothing to measure) reading as met."""
    from skistune.runtime.metrics import compute_metrics
    from skistune.runtime.request import RequestRecord

    running = RequestRecord("a", 0.0, 4, [1.0])  # one token, never finished
    m = compute_metrics([running], duration_s=4.0, kv_peak_bytes=0, kv_capacity_bytes=0, preemptions=0)
    assert m.tbt_s.count == 0
    for text in ("p99=1s", "ttft:p50<=1s", "e2e:max<=1s"):
        slo = parse_slo(text)
        assert not slo.met(m) and slo.violation(m) > 0, text
