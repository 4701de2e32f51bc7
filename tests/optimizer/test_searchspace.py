"""Search spaces: shipped files load, every sampled or grid point is a valid config that respects the
space's conditions, and broken files are rejected naming the file, the knob and the reason."""
import textwrap

import optuna
import pytest

from skistune.config import KVConfig, knob_fields
from skistune.searchspace import (
    SearchSpace,
    grid,
    grid_points,
    load_space,
    parse_space,
    shipped_spaces,
    suggest_config,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)
SHIPPED = ("default", "long-context", "memory-constrained", "sglang", "vllm")
GiB = 1 << 30
_MISSING = object()


def _space(tmp_path, body: str, name="space.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _knob(config: KVConfig, dotted: str):
    family, _, name = dotted.partition(".")
    return getattr(getattr(config, family), name)


def _conditions_hold(p, params, fixed) -> bool:
    """Re-derived from the trial's own parameters, independently of the module's bookkeeping."""
    def holds(ref, allowed):
        value = params[ref] if ref in params else fixed.get(ref, _MISSING)
        return any(value == a and type(value) is type(a) for a in allowed)

    return all(holds(*c) for c in p.when) and (not p.when_any or any(holds(*c) for c in p.when_any))


def _check_point(space: SearchSpace, config: KVConfig, params: dict) -> None:
    for name, value in space.fixed.items():
        assert _knob(config, name) == value, name
    for p in space.params:
        active = _conditions_hold(p, params, space.fixed)
        if p.kind in ("choices", "int", "float"):
            pinned = p.at_most is not None and p.name not in params and active
            assert (p.name in params) == active or pinned, (p.name, params)
        if p.is_switch or not active:
            continue
        value = _knob(config, p.name)
        if p.kind == "choices":
            assert value in p.choices
        elif p.kind in ("int", "float"):
            assert p.low <= value <= p.high or p.at_most and value <= _knob(config, p.at_most)
        elif p.kind == "same_as":
            assert value == _knob(config, p.same_as)
    assert config.batching.chunk_size <= config.batching.max_num_batched_tokens
    has_budget = config.eviction.budget_fraction is not None or config.eviction.budget_tokens is not None
    assert has_budget == (config.eviction.policy != "none")


def test_shipped_spaces_are_listed_and_load_by_name_or_path():
    assert shipped_spaces() == SHIPPED
    default = load_space("default")
    assert load_space(default) is default
    assert set(default.knob_names()) <= set(knob_fields())
    families = {n.partition(".")[0] for n in default.knob_names()}
    assert families == {"eviction", "bitwidth", "offload", "prefetch", "batching", "prefix_reuse"}
    assert default.switch_names() == ("mixed_precision",)
    assert default.param("offload.host_kv_bytes").choices == (0, 8 * GiB, 32 * GiB, 128 * GiB)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_sampled_point_is_a_valid_config_respecting_conditions(name):
    space = load_space(name)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7))
    solved = []
    solvers = {"layer_bits": lambda cfg: solved.append(cfg) or ((cfg.bitwidth.key_bits, cfg.bitwidth.value_bits),) * 2}
    policies = set()
    for _ in range(200):
        trial = study.ask()
        config = suggest_config(trial, space, solvers=solvers)
        assert isinstance(config, KVConfig)
        _check_point(space, config, trial.params)
        uses_solver = any(p.kind == "solver" for p in space.params)
        assert (config.bitwidth.layer_bits is not None) == (uses_solver and trial.params.get("mixed_precision", False))
        policies.add(config.eviction.policy)
        study.tell(trial, 0.0)
    if "eviction.policy" in space.knob_names():
        assert policies == {"none", "streaming", "h2o", "snapkv", "tova"}  # 200 draws reach every branch
    assert all(isinstance(cfg, KVConfig) for cfg in solved)


def test_engine_spaces_stay_within_what_the_engine_deploys():
    for name in ("vllm", "sglang"):
        space = load_space(name)
        assert space.fixed["eviction.policy"] == "none" and space.fixed["bitwidth.layer_bits"] is None
        assert space.param("bitwidth.key_bits").choices == (16, 8)
        assert space.param("bitwidth.value_bits").same_as == "bitwidth.key_bits"
    assert "batching.policy" not in load_space("vllm").knob_names()
    assert load_space("sglang").param("batching.policy").choices == ("fcfs", "prefix")


def test_the_vllm_space_never_proposes_more_sequences_than_the_token_budget():
    """vLLM will not start with --max-num-seqs above --max-num-batched-tokens (its SchedulerConfig checks it)."""
    space = load_space("vllm")
    assert space.param("batching.max_num_seqs").at_most == "batching.max_num_batched_tokens"
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    pairs = []
    for _ in range(300):
        trial = study.ask()
        cfg = suggest_config(trial, space)
        pairs.append((cfg.batching.max_num_seqs, cfg.batching.max_num_batched_tokens))
        study.tell(trial, 0.0)
    assert all(seqs <= budget for seqs, budget in pairs)
    assert any(budget < 1024 for _, budget in pairs)  # (budgets below the sequences' high end were drawn)


def test_tpe_handles_conditional_and_bounded_ranges():
    space = load_space("default")
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=1, n_startup_trials=5))
    for i in range(25):
        trial = study.ask()
        _check_point(space, suggest_config(trial, space), trial.params)
        study.tell(trial, float(i % 7))


def test_a_stepped_float_is_the_decimal_its_step_means():
    """Optuna gives low + k x step in binary floating point (0.5700000000000001); the config, its file and the
    engine flags get 0.57."""
    space = load_space("default")
    assert space.param("offload.device_memory_fraction").step == 0.01
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=3))
    for _ in range(40):
        trial = study.ask()
        fraction = suggest_config(trial, space).offload.device_memory_fraction
        assert fraction == round(fraction, 2) and len(repr(fraction)) <= 4, fraction
        study.tell(trial, fraction)


def test_inactive_knobs_are_null_or_kept_under_their_bound(tmp_path):
    space = load_space(_space(tmp_path, """
        knobs:
          eviction.policy: {choices: [none, h2o]}
          eviction.budget_fraction: {low: 0.1, high: 0.5, when: {eviction.policy: [h2o]}}
          batching.max_num_batched_tokens: {choices: [256, 4096]}
          batching.chunked_prefill: {choices: [false, true]}
          batching.chunk_size: {low: 64, high: 1024, at_most: batching.max_num_batched_tokens,
                                when: {batching.chunked_prefill: [true]}}
        """))
    base = KVConfig().with_knobs({"eviction.policy": "h2o", "eviction.budget_fraction": 0.3})
    chosen = {"eviction.policy": "none", "batching.max_num_batched_tokens": 256, "batching.chunked_prefill": False}
    config = suggest_config(optuna.trial.FixedTrial(chosen), space, base=base)
    assert config.eviction.policy == "none" and config.eviction.budget_fraction is None
    assert config.batching.chunk_size == 256  # base 512 pulled under the 256-token step budget
    chosen.update({"eviction.policy": "h2o", "eviction.budget_fraction": 0.2, "batching.chunked_prefill": True,
                   "batching.chunk_size": 100})
    config = suggest_config(optuna.trial.FixedTrial(chosen), space, base=base)
    assert config.eviction.budget_fraction == 0.2 and config.batching.chunk_size == 100


def test_when_any_makes_a_knob_exist_where_one_of_its_conditions_holds(tmp_path):
    """A quantization group means something where keys or values (or some layer) are quantized: in the shipped
    spaces a 16-bit config carries neither a sampled group size nor a full-precision window."""
    space = load_space(_space(tmp_path, """
        switches:
          mixed_precision: {choices: [false, true]}
        knobs:
          bitwidth.key_bits: {choices: [16, 4]}
          bitwidth.value_bits: {choices: [16, 8]}
          bitwidth.group_size: {choices: [64, 128], when_any: {bitwidth.key_bits: [4], bitwidth.value_bits: [8],
                                                               mixed_precision: [true]},
                                when: {prefix_reuse.enabled: [true]}}
        fixed:
          prefix_reuse.enabled: true
        """))
    assert [p.name for p in space.params][-1] == "bitwidth.group_size"  # decided after what it reads
    seen = set()
    for i in range(60):
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=i)).ask()
        config = suggest_config(trial, space)
        quantized = (config.bitwidth.key_bits, config.bitwidth.value_bits) != (16, 16)
        expected = quantized or trial.params["mixed_precision"]
        assert ("bitwidth.group_size" in trial.params) == expected, trial.params
        if not expected:
            assert config.bitwidth.group_size == KVConfig().bitwidth.group_size  # the base value
        seen.add((quantized, trial.params["mixed_precision"], "bitwidth.group_size" in trial.params))
    assert len(seen) == 4  # every branch reached
    default = load_space("default")
    for knob in ("bitwidth.group_size", "bitwidth.full_precision_window"):
        assert {ref for ref, _ in default.param(knob).when_any} == {"bitwidth.key_bits", "bitwidth.value_bits",
                                                                     "mixed_precision"}


@pytest.mark.parametrize("body, problem", [
    ("knobs:\n  bitwidth.group_size: {choices: [64], when_any: {bitwidth.key_bits: [4]}}\n",
     r"bitwidth.group_size: when_any bitwidth.key_bits: not in this space"),
    ("knobs:\n  bitwidth.key_bits: {choices: [16]}\n  bitwidth.group_size: {choices: [64], when_any: {bitwidth.key_bits: [4]}}\n",
     r"when_any bitwidth.key_bits: 4 is not one of its values \(16\)"),
    ("knobs:\n  bitwidth.group_size: {choices: [64], when_any: [bitwidth.key_bits]}\n",
     r"bitwidth.group_size: when_any: expected a mapping"),
    ("knobs:\n  bitwidth.key_bits: {choices: [16]}\n  bitwidth.group_size: {choices: [64], when_any: {bitwidth.key_bits: []}}\n",
     r"when_any bitwidth.key_bits: empty list of values"),
])
def test_invalid_when_any_names_the_knob_and_reason(tmp_path, body, problem):
    with pytest.raises(ValueError, match=problem):
        load_space(_space(tmp_path, body, "broken.yaml"))


def test_solvers_see_the_sampled_config_and_are_skipped_when_absent(tmp_path):
    space = load_space(_space(tmp_path, """
        switches:
          mixed_precision: {choices: [true]}
        knobs:
          bitwidth.key_bits: {choices: [4]}
          bitwidth.layer_bits: {solver: layer_bits, when: {mixed_precision: [true]}}
        """))
    seen = []
    solvers = {"layer_bits": lambda cfg: seen.append(cfg.bitwidth.key_bits) or [[8, 8], [4, 2]]}
    config = suggest_config(optuna.create_study().ask(), space, solvers=solvers)
    assert seen == [4] and config.bitwidth.layer_bits == ((8, 8), (4, 2))
    assert suggest_config(optuna.create_study().ask(), space).bitwidth.layer_bits is None
    with pytest.raises(ValueError, match="solver 'layer_bits' returned an invalid bitwidth.layer_bits"):
        suggest_config(optuna.create_study().ask(), space, solvers={"layer_bits": lambda cfg: [[3, 3]]})


def test_a_space_whose_points_break_a_joint_rule_says_how_to_fix_it(tmp_path):
    space = load_space(_space(tmp_path, """
        knobs:
          eviction.policy: {choices: [h2o]}
          eviction.budget_tokens: {low: 64, high: 128}
          eviction.budget_fraction: {low: 0.1, high: 0.5}
        """))
    with pytest.raises(ValueError, match=r"space space: the point is not a valid config \(eviction.budget_\*.*when:"):
        suggest_config(optuna.create_study().ask(), space)


# ---- grids -----------------------------------------------------------------------------------------------
TINY = """
    switches:
      mixed_precision: {choices: [false, true]}
    knobs:
      eviction.policy: {choices: [none, h2o, snapkv]}
      eviction.budget_fraction: {low: 0.1, high: 0.4, when: {eviction.policy: [h2o, snapkv]}}
      batching.max_num_batched_tokens: {low: 256, high: 1024, log: true}
      batching.chunk_size: {low: 128, high: 2048, log: true, at_most: batching.max_num_batched_tokens}
      prefetch.depth: {low: 1, high: 3}
      bitwidth.layer_bits: {solver: layer_bits, when: {mixed_precision: [true]}}
    """


def test_grid_counts_are_exact(tmp_path):
    space = load_space(_space(tmp_path, TINY))
    # switch 2 x (none 1 + h2o 3 + snapkv 3) x tokens 3 x chunk 3 (each capped range keeps 3 points) x depth 3
    points = grid_points(space, points_per_range=3)
    assert len(points) == 2 * 7 * 3 * 3 * 3
    assert sorted({p["batching.max_num_batched_tokens"] for p in points}) == [256, 512, 1024]
    assert sorted({p["batching.chunk_size"] for p in points if p["batching.max_num_batched_tokens"] == 256}) == [
        128, 181, 256]
    assert sorted({p["eviction.budget_fraction"] for p in points if "eviction.budget_fraction" in p}) == pytest.approx(
        [0.1, 0.25, 0.4])
    # five points on the integer range 1..3 round to 1, 2, 2, 2, 3: three distinct depths
    assert len(grid_points(space, points_per_range=5)) == 2 * (1 + 2 * 5) * 5 * 5 * 3
    configs = grid(space, points_per_range=2, solvers={"layer_bits": lambda cfg: [[4, 4]]})
    assert len(configs) == 2 * 5 * 2 * 2 * 2
    assert sum(c.bitwidth.layer_bits is not None for c in configs) == len(configs) // 2
    for c in configs:
        assert c.batching.chunk_size <= c.batching.max_num_batched_tokens


def test_grid_guards_its_size_and_points_per_range(tmp_path):
    with pytest.raises(ValueError, match="more than 1000 points.*lower points_per_range"):
        grid("default", points_per_range=2, max_points=1000)
    with pytest.raises(ValueError, match="points_per_range"):
        grid_points(load_space(_space(tmp_path, TINY)), points_per_range=1)


# ---- invalid spaces ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, problem", [
    ("knobs:\n  eviction.polcy: {choices: [none]}\n", r"eviction.polcy: unknown knob \(did you mean eviction.policy\?\)"),
    ("knobs:\n  eviction.budget_fraction: {low: 0.1, high: 1.5}\n", r"eviction.budget_fraction: high 1.5 is outside"),
    ("knobs:\n  batching.max_num_seqs: {low: 0, high: 8}\n", r"batching.max_num_seqs: low 0 is outside"),
    ("knobs:\n  bitwidth.key_bits: {choices: [16, 3]}\n", r"bitwidth.key_bits: choice 3 is not one of"),
    ("knobs:\n  eviction.policy: {choices: [none, quest]}\n", r"eviction.policy: choice 'quest' is not one of"),
    ("knobs:\n  prefetch.enabled: {choices: [1]}\n", r"prefetch.enabled: choice 1 is not a bool"),
    ("knobs:\n  eviction.budget_fraction: {low: 0.1, high: 0.5, when: {eviction.polcy: [h2o]}}\n",
     r"eviction.budget_fraction: when eviction.polcy: unknown knob"),
    ("knobs:\n  eviction.budget_fraction: {low: 0.1, high: 0.5, when: {eviction.policy: [h2o]}}\n",
     r"when eviction.policy: not in this space"),
    (("knobs:\n  eviction.policy: {choices: [none, h2o]}\n"
      "  eviction.budget_fraction: {low: 0.1, high: 0.5, when: {eviction.policy: [snapkv]}}\n"),
     r"when eviction.policy: 'snapkv' is not one of its values \(none, h2o\)"),
    (("knobs:\n  prefetch.depth: {low: 1, high: 4, when: {batching.max_num_seqs: [8]}}\n"
      "  batching.max_num_seqs: {low: 1, high: 8}\n"), r"conditions can test only knobs given by choices"),
    (("knobs:\n  batching.chunk_size: {low: 1, high: 8, when: {batching.chunked_prefill: [true]}}\n"
      "fixed:\n  batching.chunked_prefill: false\n"), r"when batching.chunked_prefill: True is not one of its values \(False\)"),
    ("knobs:\n  eviction.policy: {choices: [none, h2o]\n", r"not valid YAML \(.* at line 3"),
    # PyYAML keeps a repeated key's last value: the first range had been dropped without a word
    ("knobs:\n  batching.max_num_seqs: {choices: [4, 8]}\n  batching.max_num_seqs: {choices: [16]}\n",
     r"not valid YAML \(duplicate key 'batching.max_num_seqs' \(first at line 2\) at line 3, column 3\)"),
    ("knobs: [eviction.policy]\n", r"knobs: missing or empty"),
    ("knob:\n  eviction.policy: {choices: [none]}\n", r"knob: unknown section"),
    ("knobs:\n  batching.max_num_seqs: {low: 64, high: 8}\n", r"low \(64\) must be below high \(8\)"),
    ("knobs:\n  batching.max_num_seqs: {low: 1, high: 8.5}\n", r"batching.max_num_seqs: high 8.5 is not an int"),
    ("knobs:\n  batching.max_num_seqs: {type: float, low: 1, high: 8}\n", r"type 'float' does not match"),
    ("knobs:\n  offload.host_kv_bytes: {low: 0, high: 1GiB, log: true}\n", r"log scale needs low > 0"),
    ("knobs:\n  offload.host_kv_bytes: {choices: [0, 4 gigs]}\n", r"'4 gigs' is not a byte size"),
    ("knobs:\n  prefix_reuse.block_size: {low: 8, high: 64}\n", r"prefix_reuse.block_size: not a numeric range"),
    ("knobs:\n  batching.max_num_seqs: {low: 1, high: 8, lg: true}\n", r"unknown key 'lg'"),
    ("knobs:\n  batching.max_num_seqs: {low: 1, high: 8, choices: [4]}\n", r"exactly one of choices, low/high"),
    ("knobs:\n  bitwidth.layer_bits: {choices: [null]}\n", r"bitwidth.layer_bits: a structured knob"),
    ("knobs:\n  bitwidth.value_bits: {same_as: bitwidth.key_bit}\n", r"same_as bitwidth.key_bit: unknown knob"),
    ("knobs:\n  bitwidth.key_bits: {choices: [16]}\nfixed:\n  bitwidth.key_bits: 8\n", r"listed twice"),
    ("knobs:\n  bitwidth.key_bits: {choices: [16]}\nfixed:\n  bitwidth.layer_bits: [[16, 3]]\n",
     r"bitwidth.layer_bits: \[\[16, 3\]\] is not a valid value"),
    ("switches:\n  mixed.precision: {choices: [true]}\nknobs:\n  bitwidth.key_bits: {choices: [16]}\n",
     r"switches: mixed.precision: a switch name is a plain identifier"),
    ("knobs:\n  batching.chunk_size: {low: 1, high: 8, at_most: batching.chunked_prefill}\n",
     r"at_most batching.chunked_prefill: must be a knob of the same type"),
    (("knobs:\n  eviction.policy: {choices: [none, h2o], when: {eviction.layer_schedule: [pyramid]}}\n"
      "  eviction.layer_schedule: {choices: [uniform, pyramid], when: {eviction.policy: [h2o]}}\n"),
     r"eviction.policy, eviction.layer_schedule: conditions or bounds form a cycle"),
])
def test_invalid_spaces_name_the_file_knob_and_reason(tmp_path, body, problem):
    path = _space(tmp_path, body, "broken.yaml")
    with pytest.raises(ValueError, match=problem) as info:
        load_space(path)
    assert str(info.value).startswith(path + ": ")


def test_unknown_names_and_unreadable_files_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match=r"nope: no shipped search space .*shipped: default, .*pass a path"):
        load_space("nope")
    with pytest.raises(ValueError, match="cannot read search space"):
        load_space(str(tmp_path / "missing.yaml"))
    assert parse_space("knobs:\n  bitwidth.key_bits: {choices: [8]}\n", source="x").name == "x"


def test_cap_knob_drops_choices_above_the_limit_and_narrows_the_conditions_on_them():
    from skistune.searchspace import cap_knob

    space = load_space("default")
    capped, dropped = cap_knob(space, "offload.host_kv_bytes", 20 * GiB)
    assert dropped == (32 * GiB, 128 * GiB) and capped.param("offload.host_kv_bytes").choices == (0, 8 * GiB)
    assert capped.param("prefetch.enabled").when == (("offload.host_kv_bytes", (8 * GiB,)),)
    assert cap_knob(space, "offload.host_kv_bytes", 1 << 50) == (space, ())  # nothing above: unchanged
    none_left, _ = cap_knob(space, "offload.host_kv_bytes", GiB)
    assert none_left.param("prefetch.enabled").when == (("offload.host_kv_bytes", ()),)
    for i in range(30):  # no point of the capped spaces has a host tier above the cap, or one that it cannot have
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=i)).ask()
        config = suggest_config(trial, none_left)
        assert config.offload.host_kv_bytes == 0 and not config.prefetch.enabled
        assert suggest_config(optuna.create_study().ask(), capped).offload.host_kv_bytes in (0, 8 * GiB)


def test_cap_knob_cuts_an_integer_range_and_fails_when_nothing_fits(tmp_path):
    from skistune.searchspace import cap_knob

    space = load_space(_space(tmp_path, """
        name: ranged
        knobs:
          offload.host_kv_bytes: {low: 1073741824, high: 68719476736}
    """))
    capped, dropped = cap_knob(space, "offload.host_kv_bytes", 16 * GiB)
    assert capped.param("offload.host_kv_bytes").high == 16 * GiB and dropped == (f"{16 * GiB + 1}..{64 * GiB}",)
    with pytest.raises(ValueError, match="offload.host_kv_bytes: the search space's range starts at"):
        cap_knob(space, "offload.host_kv_bytes", GiB // 2)
    assert cap_knob(space, "batching.max_num_seqs", 1) == (space, ())  # a knob the space does not search


def test_format_bytes_is_exact_where_it_can_be_and_parse_bytes_reads_it_back():
    from skistune.config import format_bytes, parse_bytes

    for n in (8 * GiB, 256 * GiB, 1 << 40, 512 << 20, 1 << 10, 7):
        assert parse_bytes("x", format_bytes(n)) == n
    assert format_bytes(8 * GiB) == "8GiB" and format_bytes(int(23.5 * GiB)) == "23.5 GiB"
    assert format_bytes(24683664 * 1024) == "23.5 GiB"  # not "24683664KiB": the largest unit it reaches
