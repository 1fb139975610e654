"""The vocab-parallel cross-entropy's backward turns what it saved into the gradient in place for fp32
logits (their exponentials, as Megatron does with its softmax): a second backward through the same
graph must fail with a clear message, in every dtype alike, instead of returning a wrong gradient."""

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_second_backward_is_refused(dtype):
    logits = torch.randn(4, 64).to(dtype).requires_grad_()
    target = torch.randint(0, 64, (4,))
    loss = vocab_parallel_cross_entropy(logits, target, ParallelState.single_process().tp).sum()
    loss.backward(retain_graph=True)
    expected = torch.softmax(logits.detach().float(), -1) - torch.nn.functional.one_hot(target, 64)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.float(), expected, atol=4e-3, rtol=1e-2)
    with pytest.raises(RuntimeError, match="second backward through the vocab-parallel"):
        loss.backward()
