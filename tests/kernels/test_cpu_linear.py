"""The projection in each orientation (`kernels.linear`): the same product as ``F.linear``, in rows; the
rule that picks the orientation (`kernels.rows.ProjectionRule`), how it is measured and cached per machine."""
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from skistune.kernels import linear as linear_module
from skistune.kernels.linear import linear, machine_rule, measure_rule, measured_weights
from skistune.kernels.rows import LEGACY_RULE, PLAIN_RULE, ProjectionRule, padded_rows

RULES = [PLAIN_RULE, LEGACY_RULE, ProjectionRule(64, 1, False)]


@pytest.mark.parametrize("tokens", [1, 2, 8, 13, 15, 16, 17, 32, 37, 47, 64, 65, 131, 256, 257, 300])
@pytest.mark.parametrize("shape", [(96, 64), (1024, 64)])  # a square-ish weight and a tall one (an LM head)
@pytest.mark.parametrize("rule", RULES)
def test_linear_is_the_plain_product_in_rows(tokens, shape, rule):
    torch.manual_seed(tokens)
    w, x = torch.randn(shape), torch.randn(tokens, shape[1])
    out = linear(x, w, rule)
    assert out.shape == (tokens, shape[0]) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_orientations_of_a_rule():
    assert [PLAIN_RULE.orientation(t) for t in (1, 2, 15, 256)] == ["plain"] * 4
    assert LEGACY_RULE.orientation(1) == "padded" and padded_rows(1) == 2 and LEGACY_RULE.rows(1) == 2
    assert [LEGACY_RULE.orientation(t) for t in (2, 9, 16, 17, 24, 32, 40)] == ["flipped"] * 7
    # a few rows short of a multiple of 16: padded up to it
    assert [LEGACY_RULE.orientation(t) for t in (12, 15, 31, 63, 127)] == ["padded"] * 5
    assert padded_rows(63) == 64 and padded_rows(64) == 64 and padded_rows(65) == 80
    assert LEGACY_RULE.orientation(257) == "plain" and LEGACY_RULE.orientation(512) == "plain"
    narrow = ProjectionRule(64, 1, False)
    assert [narrow.orientation(t) for t in (1, 12, 15, 64, 65)] == ["plain", "flipped", "padded", "flipped", "plain"]
    assert narrow.rows(15) == 16 and narrow.rows(12) == 12
    assert ProjectionRule.from_dict(narrow.to_dict()) == narrow
    for bad in ({"flip_max_rows": 8}, {"flip_max_rows": "8", "pad_short_by": 0, "single_row_padded": False}):
        with pytest.raises(ValueError, match="projection rule"):
            ProjectionRule.from_dict(bad)
    with pytest.raises(ValueError, match="pad_short_by"):
        ProjectionRule(8, 16, False)


def test_padding_does_not_leak_into_the_result():
    # the zero rows are computed and dropped: the real rows equal the unpadded flipped product's
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(15, 64)
    assert LEGACY_RULE.orientation(15) == "padded"
    torch.testing.assert_close(linear(x, w, LEGACY_RULE), torch.mm(w, x.t()).t(), rtol=1e-6, atol=1e-6)


def _fake_speedups(monkeypatch, table):
    """`_speedup` answers from ``table[(rows, other)]`` (1.0 where absent); the calls are recorded."""
    calls = []

    def speedup(weights, rows, base, other, rounds):
        calls.append((rows, base, other))
        return table.get((rows, other), 1.0)
    monkeypatch.setattr(linear_module, "_speedup", speedup)
    return calls


def test_measure_rule_keeps_plain_where_flipping_loses(monkeypatch):
    calls = _fake_speedups(monkeypatch, {(1, "padded"): 0.4, (2, "flipped"): 0.44})
    assert measure_rule([torch.zeros(1, 1)]) == PLAIN_RULE
    assert calls == [(1, "plain", "padded"), (2, "plain", "flipped")]  # stops at the first loss


def test_measure_rule_finds_the_flip_range_and_padding(monkeypatch):
    flips = {(r, "flipped"): g for r, g in zip((2, 4, 8, 16, 32, 64, 128, 256), (2.5, 1.8, 1.5, 1.4, 1.3, 1.2, 1.1, 0.98))}
    _fake_speedups(monkeypatch, {(1, "padded"): 1.3, **flips, (12, "padded"): 1.02, (28, "padded"): 1.0,
                                 (60, "padded"): 1.1, (15, "padded"): 1.2, (31, "padded"): 1.1, (63, "padded"): 1.3})
    assert measure_rule([torch.zeros(1, 1)]) == ProjectionRule(128, 1, True)


def test_measure_rule_needs_a_real_gain_to_flip(monkeypatch):
    _fake_speedups(monkeypatch, {(r, "flipped"): 1.03 for r in (2, 4, 8, 16, 32, 64, 128, 256)})
    assert measure_rule([torch.zeros(1, 1)]) == PLAIN_RULE  # within noise of plain everywhere


def test_measure_rule_on_real_products_gives_a_rule():
    weights = [torch.randn(64, 32) for _ in range(3)]
    assert isinstance(measure_rule(weights, rounds=1), ProjectionRule)


def test_measured_weights_cap_the_layers_but_keep_the_lm_head(monkeypatch):
    monkeypatch.setattr(linear_module, "MEASURED_BYTES", 3 * 4 * 16)
    layers, head = [torch.zeros(4, 4) for _ in range(6)], torch.zeros(8, 4)
    picked = measured_weights(layers + [head])
    assert len(picked) == 4 and picked[-1] is head


def test_machine_rule_is_measured_once_then_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(linear_module, "SMALL_WEIGHTS_BYTES", 0)
    measured = []
    monkeypatch.setattr(linear_module, "measure_rule", lambda w: measured.append(len(w)) or LEGACY_RULE)
    weights = [torch.zeros(8, 4), torch.zeros(16, 8)]
    assert machine_rule(weights, "tiny") == LEGACY_RULE and machine_rule(weights, "tiny") == LEGACY_RULE
    assert measured == [2]
    (entry,) = (tmp_path / "skistune" / "projections").glob("tiny-*.json")
    assert json.loads(entry.read_text())["rule"] == LEGACY_RULE.to_dict()
    assert machine_rule([torch.zeros(8, 4), torch.zeros(32, 8)], "tiny") == LEGACY_RULE
    assert measured == [2, 2]  # other shapes: another entry
    entry.write_text('{"rule": {"flip')  # damaged: measured again
    machine_rule(weights, "tiny")
    assert measured == [2, 2, 2]
    # fresh (a profile timing the machine): measured again whatever is cached, and cached for the runtime
    monkeypatch.setattr(linear_module, "measure_rule", lambda w: measured.append(len(w)) or PLAIN_RULE)
    assert machine_rule(weights, "tiny", fresh=True) == PLAIN_RULE and measured == [2, 2, 2, 2]
    assert machine_rule(weights, "tiny") == PLAIN_RULE and measured == [2, 2, 2, 2]


def test_an_unwritable_cache_says_the_rule_is_not_cached_as_a_warning_once(monkeypatch, tmp_path):
    """It had been a log line with no "warning:" (`skistune` prints Python warnings as such)."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    monkeypatch.setattr(linear_module, "SMALL_WEIGHTS_BYTES", 0)
    monkeypatch.setattr(linear_module, "measure_rule", lambda w: LEGACY_RULE)
    weights = [torch.zeros(8, 4), torch.zeros(24, 8)]
    with pytest.warns(RuntimeWarning, match=r"^this CPU's projection rule is not cached \(Not a directory: .*\); "
                                            r"it is measured again in each run$"):
        assert machine_rule(weights, "tiny") == LEGACY_RULE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert machine_rule(weights, "tiny") == LEGACY_RULE  # (once a run: kept in memory)


def test_machine_rule_is_plain_without_measuring_for_small_weights_or_when_switched_off(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(linear_module, "measure_rule", lambda w: pytest.fail("measured"))
    assert machine_rule([torch.zeros(8, 4)], "tiny") == PLAIN_RULE  # in cache between steps: nothing to learn
    monkeypatch.setattr(linear_module, "SMALL_WEIGHTS_BYTES", 0)
    monkeypatch.setenv("SKISTUNE_PROJECTIONS", "plain")
    assert machine_rule([torch.zeros(8, 4)], "tiny") == PLAIN_RULE
    assert not (tmp_path / "skistune").exists()
