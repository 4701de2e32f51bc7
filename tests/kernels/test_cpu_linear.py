"""The projection in either orientation (`kernels.linear`): the same product as ``F.linear``, in rows."""
import pytest
import torch
import torch.nn.functional as F

from skistune.kernels.linear import CPU_FLIP_TOKENS, CPU_FLIP_TOKENS_TALL, TALL, linear


@pytest.mark.parametrize("tokens", [1, 2, 8, 16, 17, 32, 33, 37, 64, 65, 300])  # flipped, plain, both, neither
@pytest.mark.parametrize("shape", [(96, 64), (64 * TALL, 64)])  # a square-ish weight and a tall one (an LM head)
def test_linear_is_the_plain_product_in_rows(tokens, shape):
    torch.manual_seed(tokens)
    w, x = torch.randn(shape), torch.randn(tokens, shape[1])
    out = linear(x, w)
    assert out.shape == (tokens, shape[0]) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_flips_only_where_measured_faster():
    # the square-ish projections: multiples of 16 only (17, 37 or 63 tokens ran 20-30% slower flipped)
    assert all(t % 16 == 0 for t in CPU_FLIP_TOKENS) and 16 in CPU_FLIP_TOKENS and 17 not in CPU_FLIP_TOKENS
    # the LM head: small batches (1 row is a matrix-vector product either way; 64 rows ran slower flipped)
    assert 1 not in CPU_FLIP_TOKENS_TALL and 2 in CPU_FLIP_TOKENS_TALL and 64 not in CPU_FLIP_TOKENS_TALL
