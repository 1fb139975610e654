"""A second backward through the vocab-parallel cross-entropy (``retain_graph=True``).

Its backward recomputes the softmax from the saved logits and never modifies what it saved, so a
second backward through the same graph must add exactly the same gradient again (as any autograd
operator does), instead of a wrong one."""

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_second_backward_adds_the_same_gradient(dtype):
    logits = torch.randn(4, 64).to(dtype).requires_grad_()
    target = torch.randint(0, 64, (4,))
    loss = vocab_parallel_cross_entropy(logits, target, ParallelState.single_process().tp).sum()
    loss.backward(retain_graph=True)
    expected = torch.softmax(logits.detach().float(), -1) - torch.nn.functional.one_hot(target, 64)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.float(), expected, atol=4e-3, rtol=1e-2)
    first = logits.grad.clone()
    loss.backward()
    torch.testing.assert_close(logits.grad, first + first, atol=0, rtol=0)
