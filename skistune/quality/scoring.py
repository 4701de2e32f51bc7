"""Scoring a KV config on the real model through the runtime's own KV path: perplexity of text windows
(teacher-forced) and greedy passkey retrieval.

Every measurement serves its text through a real engine (scheduler, eviction budget, block accounting,
model runner, paged KV store at the config's bits), one sequence at a time, with the scoring protocol's
batching: prefill in chunks of `SCORING_CHUNK` tokens, so eviction compacts a sequence while its prompt is
being read and later chunks attend to what the policy kept. Only the structural knobs of a config matter
here (eviction, bitwidth, and the block size, since keys are quantized per block): the others are replaced
by the protocol's.

Perplexity: a window's first ``len - continuation`` tokens are the prompt, the last ``continuation`` are
fed one per decode step as if generated (the executor "samples" the text's next token); every computed
position's next-token loss is kept. SnapKV keeps the whole prompt until the prompt's last token is computed
(its observation window is the prompt's end), so its loss shows in the continuation.

Passkey retrieval: a five-digit key hidden at a depth of repeated filler text, then asked for; greedy
decoding must reproduce the key.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from skistune.config import KVConfig
from skistune.runtime.request import Request

SCORING_CHUNK = 128  # prefill tokens per step (and the step's token budget)
SCORING_KV_BYTES = 256 << 20  # a 4K-token prompt of SmolLM2 in fp32 is 188 MB of KV
STRUCTURAL_FAMILIES = ("eviction", "bitwidth")


def scoring_config(config: KVConfig) -> KVConfig:
    """``config``'s structural knobs under the scoring protocol's batching and pool."""
    protocol = KVConfig().with_knobs({
        "batching.chunk_size": SCORING_CHUNK, "batching.max_num_batched_tokens": SCORING_CHUNK,
        "batching.max_num_seqs": 1, "offload.device_kv_bytes": SCORING_KV_BYTES,
        "prefix_reuse.block_size": config.prefix_reuse.block_size})
    data = protocol.to_dict()
    for family in STRUCTURAL_FAMILIES:
        data[family] = getattr(config, family).to_dict()
    return KVConfig.from_dict(data)


class TeacherForced:
    """The engine's executor for scoring a text: runs the real model runner, keeps each computed position's
    loss on the text's next token, and "samples" that token, so that decode steps consume the text too."""

    def __init__(self, runner, text: list[int]) -> None:
        runner.keep_logits = True
        self.runner = runner
        self.text = text
        self.nll = torch.full((len(text) - 1,), float("nan"), dtype=torch.float64)

    def execute(self, out, kv) -> dict[str, int]:
        self.runner.execute(out, kv)
        forced = {}
        for s in out.scheduled:
            logits = self.runner.step_logits[s.seq.seq_id]  # [n, vocab] of positions start .. start + n - 1
            end = min(s.start + s.num_new_tokens, len(self.text) - 1)
            targets = torch.tensor(self.text[s.start + 1:end + 1])
            self.nll[s.start:end] = F.cross_entropy(logits[:end - s.start].double(), targets, reduction="none")
            if s.samples:
                forced[s.seq.seq_id] = self.text[s.start + s.num_new_tokens]
        return forced


def window_nll(runtime, text: list[int], continuation: int) -> torch.Tensor:
    """Per-position loss ``[len(text) - 1]`` of one window served with ``runtime``'s config."""
    engine = runtime.new_engine()
    scorer = TeacherForced(engine.executor, text)
    engine.executor = scorer
    record = engine.add_request(Request("window", text[:len(text) - continuation], continuation))
    if record.rejected_reason is not None:
        raise ValueError(f"window rejected: {record.rejected_reason}")
    engine.run_until_done()
    if scorer.nll.isnan().any():
        raise RuntimeError("a position of the window was never scored")
    return scorer.nll


@dataclass(frozen=True)
class NeedleTrial:
    """One passkey prompt: ``context_tokens`` of filler with the key at ``depth`` (0 = start, 1 = end)."""

    context_tokens: int
    depth: float
    key: str


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
QUESTION = "\nWhat is the pass key? The pass key is"
NEEDLE_NEW_TOKENS = 8  # a five-digit key and its surroundings


def needle_trials(placements: tuple[tuple[int, float], ...], seed: int = 0) -> list[NeedleTrial]:
    """Trials at the given (context tokens, depth) placements, keys drawn from a seeded generator."""
    rng = random.Random(seed)
    return [NeedleTrial(n, depth, str(rng.randint(10000, 99999))) for n, depth in placements]


def needle_prompt(tokenizer, trial: NeedleTrial) -> list[int]:
    per_filler = len(tokenizer.encode(FILLER))
    repeats = max(1, trial.context_tokens // per_filler)
    at = round(repeats * trial.depth)
    needle = f"The pass key is {trial.key}. Remember it. {trial.key} is the pass key. "
    return tokenizer.encode(INTRO + FILLER * at + needle + FILLER * (repeats - at) + QUESTION)


def needle_found(runtime, trial: NeedleTrial) -> bool:
    """Whether greedy decoding through ``runtime``'s KV path reproduces the trial's key."""
    engine = runtime.new_engine()
    record = engine.add_request(Request("needle", needle_prompt(runtime.tokenizer, trial), NEEDLE_NEW_TOKENS))
    if record.rejected_reason is not None:
        raise ValueError(f"needle prompt rejected: {record.rejected_reason}")
    engine.run_until_done()
    return trial.key in runtime.tokenizer.decode(record.output_token_ids)
