"""The projection in either orientation (`kernels.linear`): the same product as ``F.linear``, in rows."""
import pytest
import torch
import torch.nn.functional as F

from skistune.kernels.linear import CPU_FLIP_TOKENS, CPU_FLIP_TOKENS_TALL, TALL, linear


@pytest.mark.parametrize("tokens", [1, 8, CPU_FLIP_TOKENS.start, 32, CPU_FLIP_TOKENS.stop - 1, CPU_FLIP_TOKENS.stop, 300])
@pytest.mark.parametrize("shape", [(96, 64), (64 * TALL, 64)])  # a square-ish weight and a tall one (an LM head)
def test_linear_is_the_plain_product_in_rows(tokens, shape):
    torch.manual_seed(tokens)
    w, x = torch.randn(shape), torch.randn(tokens, shape[1])
    out = linear(x, w)
    assert out.shape == (tokens, shape[0]) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_tall_weight_flips_for_more_step_sizes_than_the_others():
    assert set(CPU_FLIP_TOKENS) < set(CPU_FLIP_TOKENS_TALL) and 1 not in CPU_FLIP_TOKENS_TALL
