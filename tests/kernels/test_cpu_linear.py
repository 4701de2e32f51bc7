"""The projection in each orientation (`kernels.linear`): the same product as ``F.linear``, in rows."""
import pytest
import torch
import torch.nn.functional as F

from skistune.kernels.linear import CPU_FLIP_TOKENS, cpu_orientation, linear, padded_rows


@pytest.mark.parametrize("tokens", [1, 2, 8, 13, 15, 16, 17, 32, 37, 47, 64, 65, 131, 256, 257, 300])
@pytest.mark.parametrize("shape", [(96, 64), (1024, 64)])  # a square-ish weight and a tall one (an LM head)
def test_linear_is_the_plain_product_in_rows(tokens, shape):
    torch.manual_seed(tokens)
    w, x = torch.randn(shape), torch.randn(tokens, shape[1])
    out = linear(x, w)
    assert out.shape == (tokens, shape[0]) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_orientation_follows_the_measured_rule():
    assert cpu_orientation(1) == "padded" and padded_rows(1) == 2  # two rows beat MKL's matrix-vector path
    assert [cpu_orientation(t) for t in (2, 9, 16, 17, 24, 32, 40)] == ["flipped"] * 7
    # a few rows short of a multiple of 16: padded up to it
    assert [cpu_orientation(t) for t in (12, 15, 31, 63, 127)] == ["padded"] * 5
    assert padded_rows(63) == 64 and padded_rows(64) == 64 and padded_rows(65) == 80
    assert cpu_orientation(CPU_FLIP_TOKENS.stop) == "plain" and cpu_orientation(512) == "plain"


def test_padding_does_not_leak_into_the_result():
    # the zero rows are computed and dropped: the real rows equal the unpadded flipped product's
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(15, 64)
    assert cpu_orientation(15) == "padded"
    torch.testing.assert_close(linear(x, w), torch.mm(w, x.t()).t(), rtol=1e-6, atol=1e-6)
