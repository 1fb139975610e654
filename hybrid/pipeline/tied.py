"""The tied word embedding across pipeline stages (Megatron-LM's embedding group).

The first stage looks tokens up in the word embedding ``E``; the last stage computes logits with
``E^T``. The first stage owns ``E`` (its ZeRO engine trains it); the last stage holds a copy (a leaf
tensor outside its parameters). Per step, over the embedding group (first and last stage of each
PP column, ledger kind ``embedding``):

* in its last backward through the output layer, the last stage sends the copy's gradient
  (summed over the micro-batches, loss-scaled like every other gradient) to the first stage as soon
  as autograd has accumulated it (the output layer is the first thing that backward reaches, so the
  message travels while the rest of it runs), and zeroes it at the end of the step;
* the first stage adds it into ``E``'s gradient within its own last backward (so the ZeRO reducer
  sees the sum when it reduces over DP once per step);
* after the optimizer step, the first stage sends the updated ``E`` to the last stage
  (``sync_weight``; with ``wait=False`` the last stage lands it at the start of its next step,
  while the first stage computes its first forward, instead of idling until it arrives).

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
        self._incoming = self._outgoing = self._armed = self._weight = self._received = None

    def begin_step(self) -> None:
        """First stage: post the receive of the last stage's gradient (it lands during the step).
        Last stage: land the weight of a ``sync_weight(wait=False)`` (its forward needs it)."""
        if not self.state.is_first_stage:
            self.land_weight()
        else:
            buffer = self._buffer()
            self._incoming = (buffer, comm.p2p([P2POp("recv", buffer, self.peer, _GRAD_TAG)],
                                               self.state.embedding))

    def gradient_for_first_stage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E, the last stage's gradient of it): an extra root of the first stage's last backward."""
        buffer, handle = self._incoming
        handle.wait()
        self._incoming = None
        return self.weight_of(), buffer

    def send_gradient_when_accumulated(self) -> None:
        """Last stage, just before its last backward through the output layer: send the copy's
        gradient from a hook as soon as that backward has accumulated it."""
        weight = self.weight_of()

        def send(w: torch.Tensor) -> None:
            hook.remove()
            self._send_gradient(w.grad)
        hook = weight.register_post_accumulate_grad_hook(send)
        self._armed = hook

    def end_step(self) -> None:
        """First stage: complete the send of a ``sync_weight(wait=False)`` (before the optimizer
        changes ``E``). Last stage: wait for the gradient's send (sending it now if the hook did
        not fire: the output layer got no gradient) and zero the copy's gradient."""
        if self.state.is_first_stage:
            self.land_weight()
            return
        weight = self.weight_of()
        if self._outgoing is None:
            self._armed.remove()
            self._send_gradient(weight.grad if weight.grad is not None else torch.zeros_like(weight))
        self._outgoing.wait()
        self._outgoing = self._armed = None
        weight.grad = None

    def _buffer(self) -> torch.Tensor:
        """The receive buffer (a gradient on the first stage, the weight on the last), reused
        every step: at most one receive is in flight at a time."""
        weight = self.weight_of()
        if self._received is None or self._received.dtype != weight.dtype:
            self._received = torch.empty_like(weight)
        return self._received

    def _send_gradient(self, grad: torch.Tensor) -> None:
        self._outgoing = comm.p2p([P2POp("send", grad.contiguous(), self.peer, _GRAD_TAG)],
                                  self.state.embedding)

    @torch.no_grad()
    def sync_weight(self, wait: bool = True) -> None:
        """After the optimizer step: the first stage's updated ``E`` replaces the last stage's copy.
        ``wait=False``: return at once; the last stage's copy is replaced by :meth:`land_weight`,
        which the runner's next step calls first (the first stage waits for its send at the end
        of that step, before its optimizer can change ``E`` again)."""
        self.land_weight()
        weight = self.weight_of()
        op = "send" if self.state.is_first_stage else "recv"
        buffer = weight.detach().contiguous() if op == "send" else self._buffer()
        self._weight = (buffer, comm.p2p([P2POp(op, buffer, self.peer, _WEIGHT_TAG)],
                                         self.state.embedding))
        if wait:
            self.land_weight()

    @torch.no_grad()
    def land_weight(self) -> None:
        """Complete a pending ``sync_weight``: the last stage's copy is then the first's ``E``."""
        if self._weight is None:
            return
        buffer, handle = self._weight
        handle.wait()
        self._weight = None
        if not self.state.is_first_stage:
            self.weight_of().copy_(buffer)
