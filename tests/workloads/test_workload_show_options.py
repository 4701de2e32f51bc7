"""`skistune workload show` and the workload options: what UX testers found (rate after a sample of generated
arrivals, --plot's real file, Mooncake blocks at another size, nan/inf/0 options, --first past the end,
burstiness on a handful of arrivals)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from skistune.workloads import burstiness, load_workload, prefix_reuse_ratio
from show_cli import one_line_error, run_show, show_json
from workload_paths import AZURE_CONV, BURSTGPT_1, MOONCAKE_CONV


def _run(*args: str):
    return run_show(*args)


# ---- 1. --rate holds after --sample/--first/--window thinned generated arrivals ----

@pytest.mark.parametrize("rate", ["1", "10"])
def test_rate_holds_after_a_sample_of_a_preset(rate):
    """A sample of 100 of the chat preset's 2,000 requests kept their times: the rate shown was 1/20 of --rate."""
    figures = show_json("chat", "--sample", "100", "--rate", rate)
    assert figures["requests"] == 100
    assert figures["rate_rps"] == pytest.approx(float(rate), rel=1e-12)
    assert figures["transforms"][0] == "sample 100 seed 0" and figures["transforms"][1].startswith("rate x")


def test_rate_of_generated_arrivals_is_not_rescaled_when_it_holds():
    figures = show_json("chat", "--requests", "500", "--rate", "8")
    assert figures["rate_rps"] == pytest.approx(8.0, rel=1e-12) and figures["transforms"] == []
    workload = load_workload("code", first=50, rate_rps=3.0)
    assert len(workload) / workload.duration_s == pytest.approx(3.0, rel=1e-12)
    single = load_workload("chat", sample=1, rate_rps=3.0)  # one request: no rate to set, no error
    assert len(single) == 1 and single.transforms == ("sample 1 seed 0",)


# ---- 2. --plot writes a PNG and names the file it wrote ----

def test_plot_without_suffix_writes_and_names_the_png(tmp_path):
    target = tmp_path / "x"
    result = _run("chat", "--requests", "30", "--plot", str(target), "--json")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not target.exists()
    assert f"wrote {target}.png" in result.stderr.splitlines()


@pytest.mark.parametrize("name", ["x.jpg", "x.pdf", "plot.v2"])
def test_plot_refuses_other_suffixes_before_writing(tmp_path, name):
    target = tmp_path / name
    one_line_error(_run("chat", "--requests", "30", "--plot", str(target)),
                    f"--plot {target}: the plot is a PNG file")
    assert list(tmp_path.iterdir()) == []


def test_plot_workload_returns_the_real_path(tmp_path):
    from skistune.workloads.plot import plot_workload

    written = plot_workload(load_workload("chat", requests=20), tmp_path / "w")
    assert written == tmp_path / "w.png" and written.read_bytes()[:4] == b"\x89PNG"
    upper = plot_workload(load_workload("chat", requests=20), tmp_path / "w.PNG")
    assert upper == tmp_path / "w.PNG" and upper.read_bytes()[:4] == b"\x89PNG"


# ---- 3. --block-tokens on a Mooncake trace re-cuts its 512-token hash blocks ----

MOONCAKE_HEADER_FREE = (
    '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]}\n'
    '{"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [7, 9]}\n'
    '{"timestamp": 20, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 10]}\n')


def test_mooncake_blocks_recut_to_a_smaller_size(write):
    """At 256 tokens each 512-token id becomes two; a prompt's partial last block ends at the prompt."""
    workload = load_workload(write("m.jsonl", MOONCAKE_HEADER_FREE), block_tokens=256)
    assert workload.block_tokens == 256
    a, b, c = (workload.blocks(i).tolist() for i in range(3))
    assert len(a) == 4 and len(b) == 3 and len(c) == 5  # ceil(1000/256), ceil(600/256), ceil(1100/256)
    assert b[:2] == a[:2] and b[2] != a[2]  # request B shares block 7 (512 tokens) with A, then differs
    assert c[:3] == a[:3] and c[3] != a[3]  # C shares 768 tokens with A; its 4th block ends at 1024, A's at 1000
    assert len(set(a + b + c)) == 4 + 1 + 2
    assert any("re-cut into 256-token blocks" in note for note in workload.notes)


def test_mooncake_blocks_recut_to_a_larger_size(write):
    """At 1024 tokens a block is named by the last 512-token id it holds; the reader's check of how many ids
    a prompt holds stays at 512 tokens (3 ids for 1,100 tokens used to be refused at 1024)."""
    workload = load_workload(write("m.jsonl", MOONCAKE_HEADER_FREE), block_tokens=1024)
    a, b, c = (workload.blocks(i).tolist() for i in range(3))
    assert (len(a), len(b), len(c)) == (1, 1, 2)
    assert a[0] != b[0] and c[0] != a[0]  # A's one block ends at its 1000th token, C's first at 1024
    assert prefix_reuse_ratio(workload) == 0.0


def test_mooncake_trace_at_16_token_blocks_keeps_its_reuse():
    """Relabelling the ids as 16-token blocks gave a reuse of 0.011; re-cut, the reuse is the trace's own:
    0.3566 at 16 tokens, just under its token-level hit ratio with an unbounded cache (SOURCE.md: 0.3569)."""
    native = load_workload(MOONCAKE_CONV)
    workload = load_workload(MOONCAKE_CONV, block_tokens=16)
    assert workload.block_tokens == 16
    assert np.array_equal(np.diff(workload.block_offsets), -(-workload.input_tokens // 16))
    assert prefix_reuse_ratio(native) == pytest.approx(0.3501, abs=5e-5)
    assert prefix_reuse_ratio(workload) == pytest.approx(0.3566, abs=5e-5)
    assert prefix_reuse_ratio(workload) <= 0.3569
    assert show_json(str(MOONCAKE_CONV), "--block-tokens", "16")["prefix_reuse_ratio"] == prefix_reuse_ratio(workload)


# ---- 4 and 6. --burstiness nan/inf and --jitter 0 name the option ----

@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_burstiness_must_be_positive_and_finite(value):
    one_line_error(_run("chat", "--burstiness", value), "'--burstiness'", "must be > 0 and finite")
    with pytest.raises(ValueError, match=r"^burstiness must be > 0 and finite"):
        load_workload("chat", requests=10, burstiness=float(value))


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_jitter_zero_is_an_error_not_skipped(value):
    """0 spreads nothing: it was silently skipped (and nothing recorded); it is refused like -1."""
    one_line_error(_run(str(MOONCAKE_CONV), "--jitter", value), "'--jitter'", "must be > 0 and finite")
    with pytest.raises(ValueError, match=r"^jitter_s must be > 0 and finite"):
        load_workload(MOONCAKE_CONV, jitter_s=float(value))


@pytest.mark.parametrize("args", [[str(AZURE_CONV), "--jitter", "1"], [str(AZURE_CONV), "--jitter", "0.001"],
                                  ["chat", "--jitter", "1"], [str(MOONCAKE_CONV), "--jitter", "10"]])
def test_jitter_works_off_the_step_grid(args):
    """It failed with "arrival_s must be finite, >= 0 and sorted" unless arrivals sat on the jitter step."""
    figures = show_json(*args)
    assert figures["transforms"] == [f"jitter {float(args[2]):g} s seed 0"]


# ---- 5. --first past the end records what was kept ----

def test_first_past_the_end_records_all():
    figures = show_json(str(BURSTGPT_1), "--first", "100000")
    assert figures["requests"] == 383 and figures["transforms"] == ["first 100000 (all 383)"]
    assert load_workload(BURSTGPT_1, first=383).transforms == ("first 383 (all 383)",)
    assert load_workload(BURSTGPT_1, first=10).transforms == ("first 10",)


# ---- 7. burstiness needs enough gaps ----

def test_burstiness_is_none_below_ten_gaps():
    assert burstiness(np.arange(10.0)) is None  # 9 gaps
    assert burstiness(np.arange(11.0)) == 0.0  # 10 even gaps: regular, and enough of them to say so
    assert burstiness(np.zeros(20)) is None  # all at once


def test_show_says_n_a_for_two_requests():
    """Two requests have one gap, whose CV is always 0: the chat preset read "burstiness 0.00"."""
    assert show_json("chat", "--requests", "2")["burstiness"] is None
    result = _run("chat", "--requests", "2")
    assert result.exit_code == 0 and "n/a (needs 11+ requests)" in result.stdout
    assert not math.isnan(show_json("chat", "--requests", "11")["burstiness"])


# ---- --workload-seed: `skistune optimize`'s name for the workload seed, accepted here too ----

def test_workload_seed_is_the_seed_option_under_optimizes_name():
    """A user repeating a tuned file's workload options typed optimize's --workload-seed and got "No such
    option"; --seed keeps working."""
    aliased = show_json("chat", "--requests", "20", "--workload-seed", "3")
    assert aliased == show_json("chat", "--requests", "20", "--seed", "3")
    assert aliased["digest"] != show_json("chat", "--requests", "20")["digest"]
    assert "seed=3" in aliased["source"]
    one_line_error(_run("chat", "--workload-seed", "-1"), "'--seed' / '--workload-seed'")
    assert "--seed,--workload-seed" in _run("--help").output
