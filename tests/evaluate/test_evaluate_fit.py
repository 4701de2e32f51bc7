"""`fit_to_context`: only the requests that do not fit the model's context are cut, each by as few tokens as
it needs; the note says how many requests and tokens; the optimizer's problem is fitted the same way."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from skistune.evaluate import fit_to_context, fit_workload
from skistune.workloads import Workload

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"


def _workload(inputs, outputs, **kw) -> Workload:
    n = len(inputs)
    return Workload.from_lengths("long", np.arange(n, dtype=float), np.array(inputs), np.array(outputs), **kw)


def test_only_requests_that_do_not_fit_are_cut_and_each_only_as_much_as_it_needs():
    """The tester's case: 7000+8 and 100+3000 fit 8,192 tokens and stay whole; 10000+8 loses 1,816 prompt
    tokens (8,192 - its 8 output tokens), not everything above 6,144 / 2,048 as a global cap did."""
    fitted = fit_to_context(_workload([7000, 100, 10000], [8, 3000, 8]), 8192, "smollm2-135m")
    assert fitted.input_tokens.tolist() == [7000, 100, 8184]
    assert fitted.output_tokens.tolist() == [8, 3000, 8]
    assert fitted.notes[-1] == ("1 of 3 requests do not fit smollm2-135m's 8,192-token context: each cut to fit it, "
                                "the others kept whole (1,816 of 17,100 prompt tokens cut, 11%; 0 of 3,016 output "
                                "tokens cut, 0%)")
    assert fitted.transforms[-1] == "fit 8192-token context (1 cut)"


def test_a_cut_too_small_for_a_whole_percent_is_not_called_0_percent():
    """The chat preset's 2,000 requests lose 431 of 2,355,516 prompt tokens: "0%" read as nothing cut."""
    fitted = fit_to_context(_workload([8200] + [8000] * 199, [1] * 200), 8192)
    assert fitted.notes[-1].endswith("(9 of 1,600,200 prompt tokens cut, <1%; 0 of 200 output tokens cut, 0%)")


def test_a_long_output_keeps_what_the_prompt_leaves_or_a_quarter_of_the_context():
    # 100 + 9000: the output gets the 8,092 tokens beside its prompt; 7000 + 3000: the output keeps a quarter
    # of the context (2,048) and the prompt the rest; 8000 + 8000: the same split. Every cut request fills
    # the context exactly (the fewest tokens cut)
    fitted = fit_to_context(_workload([100, 7000, 8000, 50], [9000, 3000, 8000, 50]), 8192)
    assert fitted.input_tokens.tolist() == [100, 6144, 6144, 50]
    assert fitted.output_tokens.tolist() == [8092, 2048, 2048, 50]
    assert "3 of 4 requests do not fit" in fitted.notes[-1]
    assert "2,712 of 15,150 prompt tokens cut, 18%; 7,812 of 20,050 output tokens cut, 39%" in fitted.notes[-1]


def test_a_workload_that_fits_is_returned_as_it_is_and_cut_prompts_keep_their_prefix_blocks():
    w = _workload([10, 20], [5, 5])
    assert fit_to_context(w, 64) is w
    shared = Workload(name="s", arrival_s=np.array([0.0, 1.0]), input_tokens=np.array([64, 32]),
                      output_tokens=np.array([8, 8]), block_offsets=np.array([0, 4, 6]),
                      block_ids=np.array([0, 1, 2, 3, 0, 1]), session_ids=np.array([0, 1]),
                      request_ids=np.array([0, 1]), block_tokens=16)
    fitted = fit_to_context(shared, 48)
    assert fitted.input_tokens.tolist() == [40, 32]  # 40 + 8 = 48; the second fits
    assert fitted.blocks(0).tolist() == [0, 1, 2] and fitted.blocks(1).tolist() == [0, 1]


def test_the_optimizer_searches_the_fitted_requests(tmp_path):
    """`build_problem` fits the workload with the same function: the request that fits keeps its length."""
    from skistune.optimize import build_problem
    from skistune.workloads import load_workload

    path = tmp_path / "long.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n7000,8\n100,3000\n10000,8\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problem = build_problem(load_workload(str(path)), slo="p99=10s", profile=str(PROFILE))
    lengths = [(len(r.prompt_token_ids), r.max_new_tokens) for r in problem.search.requests]
    assert lengths == [(7000, 8), (100, 3000), (8184, 8)]
    assert any(n.startswith("1 of 3 requests do not fit smollm2-135m's 8,192-token context") for n in problem.notes)
    assert fit_workload(load_workload(str(path)), "smollm2-135m").input_tokens.tolist() == [7000, 100, 8184]


@pytest.mark.parametrize("context", [2, 3, 5])
def test_tiny_contexts_leave_at_least_one_token_each(context):
    fitted = fit_to_context(_workload([100, 1], [1, 100]), context)
    assert (fitted.input_tokens >= 1).all() and (fitted.output_tokens >= 1).all()
    assert (fitted.input_tokens + fitted.output_tokens).tolist() == [context, context]
