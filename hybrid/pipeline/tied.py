"""The tied word embedding across pipeline stages (Megatron-LM's embedding group).

The first stage looks tokens up in the word embedding ``E``; the last stage computes logits with
``E^T``. The first stage owns ``E`` (its ZeRO engine trains it); the last stage holds a copy (a leaf
tensor outside its parameters). Per step, over the embedding group (first and last stage of each
PP column, ledger kind ``embedding``):

* after its last backward through the output layer, the last stage sends the copy's gradient
  (summed over the micro-batches, loss-scaled like every other gradient) to the first stage, and
  zeroes it;
* the first stage adds it into ``E``'s gradient within its own last backward (so the ZeRO reducer
  sees the sum when it reduces over DP once per step);
* after the optimizer step, the first stage sends the updated ``E`` to the last stage.

Each side moves V h / t elements twice per step: the volume of Megatron's all-reduce of the two
gradients over a group of two, plus the weight that all-reduce avoids re-sending, since here only
one stage runs the optimizer on ``E``.
"""

from __future__ import annotations

import torch

from hybrid import comm
from hybrid.comm import P2POp
from hybrid.parallel_state import ParallelState

_GRAD_TAG, _WEIGHT_TAG = 1, 2


class TiedEmbedding:
    """``weight_of()`` returns ``E`` on the first stage, the last stage's copy on the last (a tensor
    with ``requires_grad``); other stages do not build one. The copy must have the dtype of ``E``
    as the ZeRO engine keeps it (bf16 / fp16 with mixed precision: cast it once after building the
    engine), since the gradient and the weight travel in that dtype."""

    def __init__(self, state: ParallelState, weight_of):
        if state.pp_size < 2 or not (state.is_first_stage or state.is_last_stage):
            raise ValueError("the tied embedding is shared by the first and last pipeline stage only")
        self.state, self.weight_of = state, weight_of   # weight_of(): the current tensor
        self.peer = 1 - state.embedding.rank
        self._incoming = None

    def begin_step(self) -> None:
        """First stage: post the receive of the last stage's gradient (it lands during the step)."""
        if self.state.is_first_stage:
            weight = self.weight_of()
            buffer = torch.empty_like(weight)
            self._incoming = (buffer, comm.p2p([P2POp("recv", buffer, self.peer, _GRAD_TAG)],
                                               self.state.embedding))

    def gradient_for_first_stage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E, the last stage's gradient of it): an extra root of the first stage's last backward."""
        buffer, handle = self._incoming
        handle.wait()
        self._incoming = None
        return self.weight_of(), buffer

    def send_gradient(self) -> None:
        """Last stage: send the copy's gradient of this step and zero it."""
        weight = self.weight_of()
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        comm.p2p([P2POp("send", grad.contiguous(), self.peer, _GRAD_TAG)],
                 self.state.embedding).wait()
        weight.grad = None

    @torch.no_grad()
    def sync_weight(self) -> None:
        """After the optimizer step: the first stage's updated ``E`` replaces the last stage's copy."""
        weight = self.weight_of()
        op = "send" if self.state.is_first_stage else "recv"
        buffer = weight.detach().contiguous() if op == "send" else torch.empty_like(weight)
        comm.p2p([P2POp(op, buffer, self.peer, _WEIGHT_TAG)], self.state.embedding).wait()
        if op == "recv":
            weight.copy_(buffer)
