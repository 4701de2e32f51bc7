"""The corpus split (profile and held-out windows never overlap) and the grids (valid configs, each layer
probed once, the reference first)."""
import pytest

from skistune.config import KVConfig
from skistune.quality.corpus import Corpus
from skistune.quality.grid import FULL, QUICK
from skistune.quality.model import knob_key
from skistune.quality.scoring import SCORING_CHUNK, scoring_config


class ByteTokenizer:
    def encode(self, text):
        return list(text.encode())


@pytest.fixture(scope="module")
def corpus():
    return Corpus.stdlib(ByteTokenizer(), window_tokens=256)


def test_profile_and_held_out_windows_alternate_and_never_overlap(corpus):
    profile, held = corpus.windows("profile", 3), corpus.windows("heldout", 3)
    n = corpus.window_tokens
    assert profile[1] == list(corpus.token_ids[2 * n:3 * n]) and held[0] == list(corpus.token_ids[n:2 * n])
    assert all(len(w) == n for w in profile + held)
    assert not {tuple(w) for w in profile} & {tuple(w) for w in held}


def test_window_requests_beyond_the_corpus_and_unknown_splits_fail(corpus):
    with pytest.raises(ValueError, match="the corpus has"):
        corpus.windows("profile", corpus.num_windows)
    with pytest.raises(ValueError, match="split 'train'"):
        corpus.windows("train", 1)
    with pytest.raises(ValueError, match="64 tokens"):
        Corpus.stdlib(ByteTokenizer(), window_tokens=8)


def test_the_corpus_description_identifies_the_text(corpus):
    d = corpus.describe()
    assert d["tokens"] == len(corpus.token_ids) and len(d["sha256_16"]) == 16 and d["modules"] > 50
    assert Corpus.stdlib(ByteTokenizer(), 256).describe() == d  # reproducible


@pytest.mark.parametrize("grid", [FULL, QUICK], ids=["full", "quick"])
def test_every_measurement_is_a_valid_distinct_config_with_the_reference_first(grid):
    ms = grid.perplexity(30) + grid.needle()
    for m in ms:
        KVConfig().with_knobs(m.knobs)  # raises on an invalid knob
    ppl = grid.perplexity(30)
    assert ppl[0].kind == "full" and ppl[0].knobs == {}
    assert len({knob_key(m.knobs) for m in ppl}) == len(ppl)
    assert grid.needle()[0].kind == "needle-full"


def test_the_full_grid_probes_every_layer_exactly_once():
    probes = [m.knobs["bitwidth.layer_bits"] for m in FULL.perplexity(30) if m.kind == "layer"]
    counts = [sum(pairs[layer] != [16, 16] for pairs in probes) for layer in range(30)]
    assert counts == [1] * 30
    assert not any(m.kind == "layer" for m in QUICK.perplexity(30))


def test_scoring_keeps_only_structural_knobs():
    config = KVConfig().with_knobs({"eviction.policy": "tova", "eviction.budget_fraction": 0.3, "bitwidth.key_bits": 4,
                                    "batching.max_num_seqs": 64, "prefix_reuse.block_size": 32,
                                    "offload.host_kv_bytes": 1 << 30})
    scored = scoring_config(config)
    assert scored.eviction == config.eviction and scored.bitwidth == config.bitwidth
    assert scored.prefix_reuse.block_size == 32  # keys are quantized per block
    assert scored.batching.max_num_seqs == 1 and scored.batching.chunk_size == SCORING_CHUNK
    assert scored.offload.host_kv_bytes == 0
