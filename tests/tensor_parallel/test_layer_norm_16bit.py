"""hybrid.tensor_parallel.LayerNorm on 16-bit CPU inputs: fp32 statistics and gradient sums.

The output is torch's 16-bit layer norm bit for bit; the input, weight and bias gradients are compared
with the fp64 layer norm of the same 16-bit values and must be within about one rounding of it (the
weight and bias gradients sum over every token, where 16-bit partial sums lose most).
"""

import pytest
import torch
import torch.nn.functional as F

from hybrid.comm import CommLedger, Group
from hybrid.tensor_parallel import LayerNorm

H = 256


def _run(fn, x, weight, bias, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    y = fn(*leaves)
    y.backward(grad)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_layer_norm_within_one_rounding_of_fp64(dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(128, 4, H, generator=gen) * 2 + 0.5).to(dtype)
    grad = torch.randn(128, 4, H, generator=gen).to(dtype)
    ln = LayerNorm(H, Group("tp", [0], 0, CommLedger()), dtype=dtype)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.2 * torch.randn(H, generator=gen))
        ln.bias.copy_(0.2 * torch.randn(H, generator=gen))
    leaf = x.clone().requires_grad_()
    y = ln(leaf)
    y.backward(grad)
    dx, dw, db = leaf.grad, ln.weight.grad, ln.bias.grad

    def torch_ln(x, w, b):
        return F.layer_norm(x, (H,), w, b, ln.eps)

    ref = _run(torch_ln, x, ln.weight, ln.bias, grad)
    true = _run(torch_ln, x.double(), ln.weight.double(), ln.bias.double(), grad.double())
    assert torch.equal(y, ref[0])
    assert all(t.dtype == dtype for t in (dx, dw, db))
    eps = torch.finfo(dtype).eps
    for name, ours_t, true_t in (("dx", dx, true[1]), ("dw", dw, true[2]), ("db", db, true[3])):
        err = (ours_t.double() - true_t).abs()
        # one rounding (eps/2 relative) plus the fp32 computation's own error
        assert (err <= true_t.abs() * eps + 1e-3 * true_t.abs().mean()).all(), name
