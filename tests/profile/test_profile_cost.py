"""The step cost model's scalar prediction (the simulator's hot path) is the fitter's features times the
coefficients, each feature is the one its name says, and the shapes of scheduled steps count their work."""
from __future__ import annotations

import pickle
from dataclasses import fields, replace

import numpy as np
import pytest

from skistune.config import KVConfig
from skistune.kernels.rows import LEGACY_RULE
from skistune.profile.cost import (ALL_FEATURES, ProjectionTimes, StepCostModel, StepShape, decode_shape,
                                   step_shape)
from skistune.runtime.kv_layout import KVTraffic
from skistune.runtime.scheduler import Compaction, ScheduledSeq, SchedulerOutput

TABLE = ProjectionTimes((1, 2, 4, 16, 64), (0.010, 0.011, 0.015, 0.030, 0.080), (0.004, 0.004, 0.006, 0.005, 0.02))
COEF = tuple(10.0 ** -(i % 7) * (1 + i / 10) for i in range(len(ALL_FEATURES)))  # every term nonzero
PARALLEL = (170, 56, 21)  # SmolLM2's (`cost.parallel_rows`)
MODELS = {
    "plain": StepCostModel.of(COEF[:16] + (0.0,) * (len(ALL_FEATURES) - 16), knee=256),
    "table-legacy-rule": StepCostModel.of(COEF, knee=32, rows=LEGACY_RULE, small_rows=3, table=TABLE,
                                          parallel=PARALLEL),
    "sparse": StepCostModel.of([c if i % 3 else 0.0 for i, c in enumerate(COEF)], knee=8, table=TABLE,
                               parallel=PARALLEL),
}
SHAPES = [
    StepShape(1, 1, 46080, 0, 1),
    StepShape(13, 13, 13 * 700 * 46080, 0, 13),  # padded to 16 rows under the legacy rule
    StepShape(512, 1, 0, 512 * 512, 0, 512 * 46080),  # a chunk ending mid-prompt samples nothing
    StepShape(517, 6, 5 * 900 * 46080, 512 * 1024, 6, 1024 * 46080),
    StepShape(4, 4, 4 * 300 * 11520, 0, 4, decode_dequant_elements=4 * 300 * 960, quantize_elements=4 * 960,
              decode_unpack_elements=4 * 300 * 960 * 3),
    StepShape(70, 3, 2 * 200 * 11520, 68 * 400, 3, 400 * 11520, 2 * 200 * 960, 400 * 960, 70 * 960, 2 * 200 * 960,
              400 * 960, compactions=2, compacted_slots=2 * 272),
    StepShape(3000, 1, 0, 3000 * 3000, 1, 3000 * 46080),  # past the table's last size
]


@pytest.mark.parametrize("name", MODELS)
def test_the_scalar_prediction_is_the_features_times_the_coefficients(name):
    model = MODELS[name]
    for shape in SHAPES:
        x = shape.features(model.knee, model.rows, model.small_rows, model.table, model.parallel_rows)
        predicted = model.predict_s(shape)
        assert type(predicted) is float
        assert predicted == pytest.approx(float(x @ np.asarray(model.all_coef)), rel=1e-12, abs=0.0)


def test_each_feature_is_the_one_its_name_says():
    shape = StepShape(13, 5, 1003, 1004, 3, 1006, 1007, 1008, 1009, 1010, 1011, 4, 1013, 1014, 1015, 1016, 81)
    expected = {"fixed": 1.0, "seqs": 5, "tokens": 16, "tokens_past_knee": 6, "multi_token": 1.0,
                "decode_kv_bytes": 1003, "prefill_kv_bytes": 1006, "prefill_pairs": 1004, "samples": 3,
                "decode_dequant_elements": 1007, "prefill_dequant_elements": 1008, "quantize_elements": 1009,
                "decode_unpack_elements": 1010, "prefill_unpack_elements": 1011, "compactions": 4,
                "compacted_slots": 1013, "projections_s": TABLE.layers(13), "lm_head_s": TABLE.head(3),
                "parallel_kv_rows": 0.0, "parallel_hidden_rows": 1.0, "parallel_mlp_rows": 0.0,
                "mixed_paths": 1.0,  # (decode KV read and prefill pairs: decode rows beside a chunk)
                "packing_steps": 1.0, "packed_blocks": 1014, "scored_prefill_tokens": 1015,
                "scored_prefill_pairs": 1016,
                "parallel_compactions": 4.0}  # (81 slots kept by 4 compactions: more than 20 each, the KV grain)
    assert list(expected) == list(ALL_FEATURES)
    parallel = (20, 12, 13)  # 13 tokens are past 12, not past 13: the tokens count, not the 16 rows they pad to
    x = shape.features(10, LEGACY_RULE, 12, TABLE, parallel)  # 13 tokens: 16 rows under the legacy rule
    assert x.dtype == np.float64 and x.tolist() == list(expected.values())
    for i, name in enumerate(ALL_FEATURES):  # one coefficient at a time: the prediction reads that feature
        unit = StepCostModel.of([1.0 if j == i else 0.0 for j in range(len(ALL_FEATURES))], 10, LEGACY_RULE, 12,
                                TABLE, parallel)
        assert unit.predict_s(shape) == expected[name], name


def test_elementwise_ops_go_parallel_past_torchs_grain_at_the_models_widths():
    from skistune.profile.cost import TORCH_GRAIN_ELEMENTS, parallel_rows
    from skistune.runtime.presets import get_preset

    smollm = get_preset("smollm2-135m")  # KV rows of 3 x 64, hidden 576, MLP 1536
    assert parallel_rows(smollm, "cpu") == PARALLEL
    assert all(r * w <= TORCH_GRAIN_ELEMENTS < (r + 1) * w for r, w in zip(PARALLEL, (192, 576, 1536)))
    assert parallel_rows(smollm, "cuda") == ()  # no such switch on a GPU: the terms stay zero
    weights = {"parallel_kv_rows": 100.0, "parallel_hidden_rows": 10.0, "parallel_mlp_rows": 1.0}
    only = StepCostModel.of([weights.get(f, 0.0) for f in ALL_FEATURES], knee=8, parallel=PARALLEL)
    added = {n: only.predict_s(StepShape(n, 1, 0, n * n, 1)) for n in (21, 22, 56, 57, 170, 171)}
    assert added == {21: 0.0, 22: 1.0, 56: 1.0, 57: 11.0, 170: 11.0, 171: 111.0}


def test_a_model_reads_its_parallel_rows_back_and_older_files_have_none():
    model = MODELS["sparse"]
    assert StepCostModel.from_dict(model.to_dict()) == model
    older = model.to_dict()
    older["features"], older["coef"] = older["features"][:-9], older["coef"][:-9]  # (the parallel terms and later)
    del older["parallel_rows"]
    read = StepCostModel.from_dict(older)
    assert read.parallel_rows == () and read.parallel_coef == (0.0, 0.0, 0.0)
    bad = {**model.to_dict(), "parallel_rows": [56, 21]}
    with pytest.raises(ValueError, match=r"step.cost_model: parallel_rows needs 3 token counts"):
        StepCostModel.from_dict(bad)
    with pytest.raises(ValueError, match=r"step.cost_model: parallel terms without the parallel_rows"):
        StepCostModel.from_dict({**model.to_dict(), "parallel_rows": []})
    with pytest.raises(ValueError, match=r"step.cost_model.parallel_rows\[0\]"):
        StepCostModel.from_dict({**model.to_dict(), "parallel_rows": [0, 56, 21]})


def test_the_mixed_term_counts_steps_that_run_decode_rows_beside_a_prefill_chunk():
    from skistune.runtime.request import Request
    from skistune.runtime.scheduler import Sequence

    mixed_only = StepCostModel.of([float(f == "mixed_paths") for f in ALL_FEATURES], knee=8)

    def seq(prompt: int, computed: int) -> Sequence:
        s = Sequence(Request(f"r{prompt}-{computed}", list(range(1, prompt + 1)), 8), None)
        s.num_computed_tokens = computed
        return s

    decode, chunk, other_chunk = (ScheduledSeq.of(seq(40, 40), 40, 1, 40), ScheduledSeq.of(seq(64, 0), 0, 32, 0),
                                  ScheduledSeq.of(seq(20, 0), 0, 20, 0))
    added = {name: mixed_only.predict_s(step_shape(SchedulerOutput(list(steps)), 46080))
             for name, steps in {"decode": [decode], "chunk": [chunk], "chunks": [chunk, other_chunk],
                                 "decode beside a chunk": [decode, chunk]}.items()}
    assert added == {"decode": 0.0, "chunk": 0.0, "chunks": 0.0, "decode beside a chunk": 1.0}
    assert mixed_only.predict_s(decode_shape(8, 800, KVTraffic(46080))) == 0.0  # (the simulator's decode runs)


def test_a_file_written_before_the_mixed_term_reads_it_as_zero_and_says_it_fitted_fewer_terms():
    model = MODELS["table-legacy-rule"]
    assert StepCostModel.from_dict(model.to_dict()).fitted_terms == len(ALL_FEATURES)
    older = model.to_dict()
    later = {"packing_coef": (0.0, 0.0), "scored_coef": (0.0, 0.0), "parallel_compaction_coef": (0.0,)}  # (in order)
    older["features"], older["coef"] = older["features"][:-6], older["coef"][:-6]  # (the terms after mixed)
    read = StepCostModel.from_dict(older)
    assert read.mixed_coef == (0.0,) and read.fitted_terms == len(ALL_FEATURES) - 6
    # (how many terms a file had is not part of the model)
    assert read == replace(model, mixed_coef=(0.0,), **later)
    for dropped, zeroed in ((5, list(later)), (3, list(later)[1:]), (1, list(later)[2:])):
        older["features"], older["coef"] = model.to_dict()["features"][:-dropped], model.to_dict()["coef"][:-dropped]
        read = StepCostModel.from_dict(older)
        assert read == replace(model, **{k: later[k] for k in zeroed}) and read.mixed_coef == model.mixed_coef


def test_the_packing_terms_count_the_blocks_a_quantized_step_completes():
    from skistune.profile.cost import completed_blocks

    kv = KVTraffic(bytes_per_token=100, quantized_elements_per_token=7, block_size=16)
    # decodes reading their 16th and 10th slot, chunks of 37 tokens after 10 and of 5 from the start
    out = SchedulerOutput(scheduled=[_seq(1, 15, True), _seq(1, 9, True), _seq(37, 10, False), _seq(5, 0, True)])
    assert completed_blocks(out, 16) == 1 + 0 + 2 + 0
    assert step_shape(out, kv).packed_blocks == 3
    assert step_shape(out, replace(kv, quantized_elements_per_token=0, block_size=0)).packed_blocks == 0  # 16-bit
    packing = StepCostModel.of([{"packing_steps": 0.005, "packed_blocks": 0.001}.get(f, 0.0) for f in ALL_FEATURES],
                               knee=8)
    assert packing.predict_s(step_shape(out, kv)) == pytest.approx(0.005 + 3 * 0.001)
    assert packing.predict_s(step_shape(SchedulerOutput(scheduled=[_seq(1, 9, True)]), kv)) == 0.0
    assert packing.packing_s(np.array([0, 1, 4])) == pytest.approx([0.0, 0.006, 0.009])


def test_the_scored_prefill_terms_count_the_chunks_of_a_policy_that_scores_by_attention():
    from skistune.runtime.eviction import POLICIES
    from skistune.runtime.eviction_budget import SCORING_POLICIES
    from skistune.runtime.kv_layout import kv_traffic
    from skistune.runtime.presets import get_preset

    assert SCORING_POLICIES == {name for name, policy in POLICIES.items() if policy.needs_attention}
    spec = get_preset("smollm2-135m")
    traffic = {p: kv_traffic(KVConfig().with_knobs({"eviction.policy": p, "eviction.budget_tokens": 64}
                                                   if p != "none" else {}), spec, 2).scored_prefill
               for p in ("none", "streaming", "h2o", "tova", "snapkv")}
    assert traffic == {"none": False, "streaming": False, "h2o": True, "tova": True, "snapkv": True}
    scored = KVTraffic(bytes_per_token=100, scored_prefill=True)
    # two decodes (a one-token chunk runs the decode path), chunks of 37 tokens after 10 and of 5 from the start
    out = SchedulerOutput(scheduled=[_seq(1, 15, True), _seq(1, 9, True), _seq(37, 10, False), _seq(5, 0, True)])
    shape = step_shape(out, scored)
    assert (shape.scored_prefill_tokens, shape.scored_prefill_pairs) == (42, 37 * 47 + 5 * 5)
    assert shape.prefill_pairs == 37 * 47 + 5 * 5
    plain = step_shape(out, replace(scored, scored_prefill=False))
    assert (plain.scored_prefill_tokens, plain.scored_prefill_pairs) == (0, 0)
    assert plain == shape._replace(scored_prefill_tokens=0, scored_prefill_pairs=0)
    terms = StepCostModel.of([{"scored_prefill_tokens": 1e-4, "scored_prefill_pairs": 1e-7}.get(f, 0.0)
                              for f in ALL_FEATURES], knee=8)
    assert terms.predict_s(shape) == pytest.approx(42e-4 + (37 * 47 + 5 * 5) * 1e-7)
    assert terms.predict_s(step_shape(SchedulerOutput(scheduled=[_seq(1, 9, True)]), scored)) == 0.0  # decodes


def test_a_compaction_whose_kept_slots_pass_the_kv_rows_grain_costs_the_parallel_term():
    term = StepCostModel.of([{"compactions": 0.01, "compacted_slots": 1e-5, "parallel_compactions": 0.015}.get(f, 0.0)
                             for f in ALL_FEATURES], knee=8, parallel=PARALLEL)  # KV rows past 170 go parallel
    out = SchedulerOutput(scheduled=[_seq(1, 175, True)], compactions=[Compaction("a", 176, 160, (), (), ())])
    assert step_shape(out, 100).compacted_kept_slots == 160
    assert term.predict_s(step_shape(out, 100)) == pytest.approx(0.01 + 176e-5) == term.compaction_s(176, 160)
    out = SchedulerOutput(scheduled=[_seq(1, 191, True)], compactions=[Compaction("a", 192, 176, (), (), ())])
    assert term.predict_s(step_shape(out, 100)) == pytest.approx(0.025 + 192e-5) == term.compaction_s(192, 176)
    # two compactions of a step count as past the grain when their mean kept slots are
    both = SchedulerOutput(scheduled=[_seq(1, 191, True), _seq(1, 175, True)],
                           compactions=[Compaction("a", 192, 176, (), (), ()), Compaction("b", 176, 160, (), (), ())])
    assert term.predict_s(step_shape(both, 100)) == pytest.approx(0.02 + 368e-5)  # mean 168: neither
    assert replace(term, parallel_rows=(), parallel_coef=(0.0,) * 3).compaction_s(192, 176) == pytest.approx(
        0.01 + 192e-5)  # (no grain: a GPU's profile)


def test_the_cached_coefficients_leave_equality_hash_and_files_alone():
    model, twin = (StepCostModel.of(COEF, knee=32, rows=LEGACY_RULE, small_rows=3, table=TABLE, parallel=PARALLEL)
                   for _ in "ab")
    model.predict_s(SHAPES[0])  # caches ``all_coef`` on one of them
    assert "all_coef" not in {f.name for f in fields(StepCostModel)}
    assert model == twin and hash(model) == hash(twin) and repr(model) == repr(twin)
    assert model.to_dict() == twin.to_dict() and StepCostModel.from_dict(model.to_dict()) == model
    assert pickle.loads(pickle.dumps(model)) == model
    changed = replace(model, coef=tuple(2 * c for c in model.coef))  # a new model computes its own
    assert changed.all_coef[:len(model.coef)] == tuple(2 * c for c in model.coef)
    assert changed.predict_s(SHAPES[3]) > model.predict_s(SHAPES[3])


def _seq(new: int, kv_start: int, samples: bool) -> ScheduledSeq:
    # (step_shape never reads the sequence)
    return ScheduledSeq(seq=None, start=kv_start, num_new_tokens=new, samples=samples, kv_start=kv_start)


def test_a_scheduled_step_counts_its_tokens_contexts_and_compactions():
    kv = KVTraffic(bytes_per_token=100, quantized_elements_per_token=7, ring_bytes_per_seq=50,
                   unpacked_elements_per_token=3)
    out = SchedulerOutput(scheduled=[_seq(1, 99, True), _seq(1, 9, True), _seq(37, 10, False), _seq(5, 0, True)],
                          compactions=[Compaction("a", 272, 256, (), (), ()), Compaction("b", 40, 32, (), (), ())])
    decode, prefill = 100 + 10, 47 + 5  # KV slots the decodes and the chunks read
    assert step_shape(out, kv) == StepShape(
        num_tokens=out.num_batched_tokens, num_seqs=4, decode_kv_bytes=decode * 100 + 2 * 50,
        prefill_pairs=37 * 47 + 5 * 5, num_samples=3, prefill_kv_bytes=prefill * 100 + 2 * 50,
        decode_dequant_elements=decode * 7, prefill_dequant_elements=prefill * 7, quantize_elements=44 * 7,
        decode_unpack_elements=decode * 3, prefill_unpack_elements=prefill * 3, compactions=2,
        compacted_slots=272 + 40, compacted_kept_slots=256 + 32)
    assert out.num_batched_tokens == 44
    decodes = SchedulerOutput(scheduled=[_seq(1, 99, True), _seq(1, 9, True), _seq(1, 500, True)])
    assert step_shape(decodes, kv) == decode_shape(3, 100 + 10 + 501, kv)
    assert step_shape(decodes, 100) == decode_shape(3, 100 + 10 + 501, KVTraffic(100))
