"""The tiers' measured figures agree with each other: a run that moves no block records no transfer or stall
time (it had read 0.07 ms of transfers and 0.29 ms of stalls next to no bytes moved, and `--mode compare`
then showed a -100% error against the simulator's 0), while a run that moves blocks still records its time."""
import warnings
from pathlib import Path

import pytest
import torch

from skistune.config import KVConfig
from skistune.evaluate import evaluate
from skistune.profile import FingerprintWarning, load_profile
from skistune.runtime.llm import Runtime
from skistune.runtime.request import Request

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def rt():
    return Runtime.from_preset(MODEL, KVConfig().with_knobs({"offload.device_kv_bytes": 16 << 20}))


def prompts(n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 10000, (length,), generator=g).tolist() for _ in range(n)]


def test_a_run_that_moves_nothing_records_no_transfer_or_stall_time(rt):
    config = {"offload": {"device_kv_bytes": 16 << 20, "host_kv_bytes": 64 << 20}}
    reqs = [Request(f"r{i}", p, 4) for i, p in enumerate(prompts(4, 40))]
    measured = evaluate(config, reqs, model=MODEL, mode="run", runtime=rt).tiers
    assert measured.moved_bytes == {} and measured.promotions == measured.demotions == 0
    assert measured.transfer_s == 0.0 and measured.stall_s == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FingerprintWarning)
        profile = load_profile(SHIPPED)
    predicted = evaluate(config, reqs, model=MODEL, mode="simulate", profile=profile).tiers
    assert predicted.moved_bytes == {} and predicted.transfer_s == 0.0 and predicted.stall_s == 0.0


def test_a_run_that_moves_blocks_still_records_their_time(rt):
    """A device pool of a few blocks: each prompt's cached blocks go to the host when the next reuses them,
    and the first prompt's come back when it is sent again."""
    block_bytes = rt.store.block_bytes
    engine = rt.with_config(KVConfig().with_knobs({"offload.device_kv_bytes": 8 * block_bytes,
                                                   "offload.host_kv_bytes": 16 * block_bytes})).new_engine()
    a, b, c = prompts(3, 64, seed=1)  # 4 blocks each (of 16 tokens)
    for i, p in enumerate([a, b, c, a]):  # one at a time
        engine.add_request(Request(f"r{i}", p, 2))
        engine.run_until_done()
    tiers = engine.metrics(1.0).tiers
    assert tiers.demotions > 0 and tiers.promotions > 0 and sum(tiers.moved_bytes.values()) > 0
    assert tiers.transfer_s > 0 and tiers.stall_s > 0
