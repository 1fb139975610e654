"""One runner for every pipeline schedule (Narayanan et al. 2021 §2.2; Megatron's ``schedules.py``).

:class:`PipelineRunner` executes this stage's action list (:mod:`hybrid.pipeline.schedules`) for one
step. Activations go forward and their gradients back through :func:`hybrid.comm.p2p` on the PP
group (ledger kind ``pp``). The shape of every message is known up front, ``[s, b, h]`` or the
sequence shard ``[s/t, b, h]`` with sequence parallelism, so no shape is exchanged. Sends are not
waited for until the end of the step. How receives are posted (``prefetch``):

* gloo (default there): the next action's receive is posted before this action computes, so it
  lands during the compute (tagged isend/irecv match by tag, in any order);
* NCCL (default there): the actions form exchange groups (:func:`exchange_groups`); after a
  group computes, its sends and the next group's receives go in one ``batch_isend_irecv``
  (Megatron's ``send_forward_recv_backward`` pattern per action, and in the steady state its
  ``send_forward_backward_recv_forward_backward`` for a forward and the backward after it). NCCL
  serialises the sends and receives between two ranks on one stream and a batch completes only
  when every message in it is matched, so a receive posted ahead of a send the peer is waiting for
  could deadlock; the groups make neighbouring stages' batches match. One group per action
  deadlocks the interleaved schedule's steady state (m > p): two neighbours each wait on a batch
  whose send the other receives only in its next batch. ``tests/pipeline/test_pipeline.py`` checks every
  schedule's groups under rendezvous semantics.

Per step and stage boundary the schedule moves m activations forward and m gradients back (m v of
each when interleaved, over the p v - 1 boundaries of the virtual pipeline), each b s h elements
(b s h / t with sequence parallelism).

Gradients: the ZeRO engine (stages 0-2) is told each backward with ``engine.backward``; it counts
them (``gradient_accumulation_steps`` must be m v, the backwards of this stage per step) and reduces
over DP once per step, in the step's last backward, as it does for gradient accumulation (stage 2
runs as stage 1 under pipeline parallelism:
:func:`hybrid.zero_policy.stage_with_pipeline`). The
last virtual stage's backward starts from its loss (multiplied by the loss scale), every other from
the received gradient (already scaled). The tied embedding's gradient goes from the last stage to
the first before the first stage's last backward (:mod:`hybrid.pipeline.tied`), sent from a hook as
soon as the last stage's final backward has produced it, so it travels during the rest of that
backward.

The step's objective is ``loss scale x sum_i L_i / m`` (``L_i`` the mean of what the last chunk
returns for micro-batch i). A chunk whose layers need ``sum_t d(objective) / d(loss_t)`` over a
micro-batch's per-token losses (MoE aux / z losses: models/gpt/moe.py) says so with
``needs_loss_gradient`` and receives it before each of its backwards through
``set_loss_gradient(g)``, ``g = loss scale x w_i / m``, on every stage: the engine's scaler, m and
the micro-batch are known everywhere, so nothing travels with the activation gradients. ``w_i =
sum_t d(L_i) / d(loss_t)`` is 1 when the last chunk returns the per-token loss, else the
``loss_weight`` callable's (a masked mean: the kept fraction).

Per-step costs kept off the critical path: receive buffers come from a free list (an activation's
is reused after the backward that consumed it, a gradient's after its backward), the last stage's
loss is summed as a tensor and read once per step (no device sync per micro-batch), and an
activation gradient is posted right after its backward, never behind the tied embedding's message.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybrid import comm
from hybrid.comm import P2POp
from hybrid.parallel_state import ParallelState
from hybrid.pipeline.config import PipelineConfig
from hybrid.pipeline.schedules import Action, build_schedule, forward_only
from hybrid.pipeline.tied import TiedEmbedding


@dataclass
class StepOutput:
    loss_tensor: torch.Tensor | None   # mean loss of the step's micro-batches (last stage), 0-dim
    step_time: float          # seconds of this stage's step
    busy_time: float          # seconds spent computing (forward and backward)
    peak_held: int            # most micro-batch activations (per chunk) held at once

    @property
    def loss(self) -> float | None:
        """The loss read to the host (a device sync: the trainer keeps ``loss_tensor``)."""
        return None if self.loss_tensor is None else float(self.loss_tensor)

    def bubble(self, pipeline_step_time: float) -> float:
        """This stage's idle time over the pipeline's step time (see :meth:`PipelineRunner.bubble`)."""
        return 1.0 - self.busy_time / pipeline_step_time if pipeline_step_time else 0.0


def exchange_groups(actions: list[Action]) -> list[list[int]]:
    """Indices of a stage's actions grouped for NCCL's batched posting: after the stage's first
    backward, a forward and the backward right after it are one group (the steady state's
    one-forward-one-backward step); every other action is a group of its own."""
    groups, i, steady = [], 0, False
    while i < len(actions):
        steady = steady or actions[i].kind == "B"
        if steady and i + 1 < len(actions) and (actions[i].kind, actions[i + 1].kind) == ("F", "B"):
            groups.append([i, i + 1])
        else:
            groups.append([i])
        i += len(groups[-1])
    return groups


class PipelineRunner:
    """Runs a step of the schedule on this rank's model chunks (``chunks[c]``: virtual stage
    ``c * p + stage``). A chunk is called ``chunk(tokens, labels, hidden_states=x)``: the first
    virtual stage ignores ``x``, the last returns the per-token loss [b, s], every other returns
    its output [s(/t), b, h]. A micro-batch is ``(tokens, labels)`` or ``(tokens, labels,
    layout)``; a layout that is not None is passed to every chunk as ``layout=``.
    ``loss_weight(micro_batch)``: ``sum_t d(mean of the last chunk's output) / d(loss_t)`` for the
    chunks that need the loss gradient (module docstring); None: 1."""

    def __init__(self, state: ParallelState, config: PipelineConfig, chunks: list[nn.Module], *,
                 activation_shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 engine=None, tied: TiedEmbedding | None = None, prefetch: bool | None = None,
                 loss_weight: Callable[[tuple], torch.Tensor] | None = None):
        if config.num_stages != state.pp_size:
            raise ValueError(f"the pipeline config has {config.num_stages} stages but the parallel "
                             f"state's PP group has {state.pp_size} ranks")
        if len(chunks) != config.num_model_chunks:
            raise ValueError(f"{len(chunks)} model chunks on this stage, the config says "
                             f"{config.num_model_chunks}")
        self.state, self.chunks = state, chunks
        self.shape, self.dtype, self.engine, self.tied = activation_shape, dtype, engine, tied
        self.stage, self.p, self.v = state.pp_rank, config.num_stages, config.num_model_chunks
        self.loss_weight = loss_weight
        # the chunks given sum_t d(objective) / d(loss_t) before each backward (MoE aux losses)
        self._wants_loss_gradient = {c for c, chunk in enumerate(chunks)
                                     if getattr(chunk, "needs_loss_gradient", False)}
        self._plan(config)
        if prefetch is None:   # module docstring: gloo posts receives ahead, NCCL batches them
            pg = state.pp.pg
            prefetch = pg is None or torch.distributed.get_backend(pg) == "gloo"
        self.prefetch = prefetch
        # receive buffers, reused across micro-batches and steps: an activation's once the
        # backward that consumed it is done, a gradient's once its backward is done
        self._free: dict[str, list[torch.Tensor]] = {"F": [], "B": []}

    def _plan(self, config: PipelineConfig) -> None:
        """This stage's actions for ``config`` and what the step derives from them."""
        actions = build_schedule(config)[self.stage]
        backwards = sum(a.kind == "B" for a in actions)   # m v (RunLayout.backwards_per_step)
        engine = self.engine
        if engine is not None and engine.config.gradient_accumulation_steps != backwards:
            raise ValueError(f"the ZeRO engine expects {engine.config.gradient_accumulation_steps} "
                             f"backward passes per step, the pipeline runs {backwards} on each stage "
                             f"(micro-batches x model chunks); set gradient_accumulation_steps to it")
        self.config, self.actions = config, actions
        groups = exchange_groups(actions)   # NCCL: after group g, its sends + g+1's receives
        self._exchange_after = {g[-1]: (groups[k + 1] if k + 1 < len(groups) else [])
                                for k, g in enumerate(groups)}
        self._last_backward = {c: max(i for i, a in enumerate(actions)
                                      if a.kind == "B" and a.chunk == c) for c in range(self.v)}

    def set_micro_batches(self, m: int) -> None:
        """Run ``m`` micro-batches per step from the next step on (a batch ramp); the engine must
        already count m v backwards (``ZeroEngine.set_gradient_accumulation_steps``)."""
        if m != self.config.num_micro_batches:
            self._plan(dataclasses.replace(self.config, num_micro_batches=m))

    # ---- messages ------------------------------------------------------------------------------
    def _virtual(self, action: Action) -> int:
        return action.chunk * self.p + self.stage

    def _tag(self, kind: str, micro_batch: int, destination: int) -> int:
        """One tag per message of a step: (micro-batch, destination virtual stage, direction)."""
        return (micro_batch * self.p * self.v + destination) * 2 + (kind == "B")

    def _needs_input(self, action: Action) -> bool:
        k = self._virtual(action)
        return k > 0 if action.kind == "F" else k < self.p * self.v - 1

    def _post_receive(self, action: Action) -> None:
        key = (action.kind, action.micro_batch, action.chunk)
        if key in self._received or not self._needs_input(action):
            return
        k = self._virtual(action)
        peer = (self.stage - 1) % self.p if action.kind == "F" else (self.stage + 1) % self.p
        free = self._free[action.kind]
        buffer = free.pop() if free else torch.empty(self.shape, dtype=self.dtype,
                                                     device=self.state.device)
        self._pending.append(P2POp("recv", buffer, peer, self._tag(action.kind, action.micro_batch, k)))
        self._received[key] = [buffer, None]   # its handle comes with the batch (_flush)

    def _send(self, tensor: torch.Tensor, kind: str, micro_batch: int, destination: int) -> None:
        peer = (self.stage + 1) % self.p if kind == "F" else (self.stage - 1) % self.p
        self._pending.append(P2POp("send", tensor.detach().contiguous(), peer,
                                   self._tag(kind, micro_batch, destination)))

    def _flush(self) -> None:
        """Post the queued sends and receives as one batch."""
        if not self._pending:
            return
        handle = comm.p2p(self._pending, self.state.pp)
        for op in self._pending:
            if op.op == "send":
                self._sends.append((op.tensor, handle))
        for entry in self._received.values():
            if entry[1] is None:
                entry[1] = handle
        self._pending = []

    def _take(self, action: Action) -> torch.Tensor:
        buffer, handle = self._received.pop((action.kind, action.micro_batch, action.chunk))
        handle.wait()
        return buffer

    # ---- the step ------------------------------------------------------------------------------
    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepOutput:
        """Forward and backward of ``micro_batches`` (m pairs of tokens and labels [b, s], the same
        on every stage) per the schedule; the caller then calls ``engine.step()``."""
        if len(micro_batches) != self.config.num_micro_batches:
            raise ValueError(f"{len(micro_batches)} micro-batches, the pipeline config says "
                             f"{self.config.num_micro_batches}")
        self._received, self._sends, self._held, self._pending = {}, [], {}, []
        loss, busy, peak, start = None, 0.0, 0, time.perf_counter()
        last_stage = self.p * self.v - 1
        if self.tied is not None:
            self.tied.begin_step()
        for i, action in enumerate(self.actions):
            self._post_receive(action)
            if self.prefetch and i + 1 < len(self.actions):   # arrives during this action
                self._post_receive(self.actions[i + 1])
            if self.prefetch or i == 0:   # NCCL: later receives came with the last exchange
                self._flush()
            inputs = self._take(action) if self._needs_input(action) else None
            final = action.kind == "B" and i == self._last_backward[action.chunk]
            tied = self.tied if final else None
            extra = tied.gradient_for_first_stage() if tied and self._virtual(action) == 0 else None
            if tied and self._virtual(action) == last_stage:   # sent while this backward runs
                tied.send_gradient_when_accumulated()
            began = time.perf_counter()
            if action.kind == "F":
                out = self._forward(action, micro_batches[action.micro_batch], inputs)
                if out is not None:   # the loss, summed as a tensor: no device sync per micro-batch
                    loss = out if loss is None else loss + out
                peak = max(peak, len(self._held))
            else:
                if action.chunk in self._wants_loss_gradient:
                    self._set_loss_gradient(action, micro_batches[action.micro_batch])
                self._backward(action, inputs, extra)
            busy += time.perf_counter() - began
            if self.prefetch:
                self._flush()
            elif i in self._exchange_after:   # the group's sends with the next group's receives
                for j in self._exchange_after[i]:
                    self._post_receive(self.actions[j])
                self._flush()
        if self.tied is not None:
            self.tied.end_step()
        for _, handle in self._sends:
            handle.wait()
        self._sends = []
        return StepOutput(loss, time.perf_counter() - start, busy, peak)   # the loss stays on the device

    def bubble(self, output: StepOutput) -> float:
        """The measured bubble of this stage: idle time over the step time of the whole pipeline
        (the longest stage's, all stages starting together after the previous optimizer step).
        Collective over the PP group (a control all-reduce, not recorded)."""
        return float(self.bubble_tensor(output))

    def bubble_tensor(self, output: StepOutput) -> torch.Tensor:
        """:meth:`bubble` as a 0-dim float64 tensor on the device: the host clocks enter as fills
        and nothing is read back (the trainer sums it and reads it once per log interval)."""
        def fill(x: float) -> torch.Tensor:
            return torch.full((1,), x, dtype=torch.float64, device=self.state.device)
        longest = fill(output.step_time)
        with comm.unrecorded(self.state.pp):
            comm.all_reduce(longest, self.state.pp, op="max")
        busy = fill(output.busy_time)
        return torch.where(longest > 0, 1.0 - busy / longest, torch.zeros_like(longest)).reshape(())

    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Evaluation: the forwards of ``micro_batches`` (:func:`~hybrid.pipeline.schedules.forward_only`),
        no backward and no gradient; the mean loss on the last stage, else None."""
        if len(micro_batches) != self.config.num_micro_batches:
            raise ValueError(f"{len(micro_batches)} micro-batches, the pipeline config says "
                             f"{self.config.num_micro_batches}")
        actions = forward_only(self.config)[self.stage]
        if self.tied is not None:   # an asynchronous weight sync of the last step must land first
            self.tied.land_weight()
        self._received, self._sends, self._held, self._pending = {}, [], {}, []
        losses = []
        for i, action in enumerate(actions):
            self._post_receive(action)
            if self.prefetch and i + 1 < len(actions):
                self._post_receive(actions[i + 1])
            self._flush()
            inputs = self._take(action) if self._needs_input(action) else None
            loss = self._forward(action, micro_batches[action.micro_batch], inputs)
            self._held.clear()
            if loss is not None:
                losses.append(loss)
            if not self.prefetch and i + 1 < len(actions):
                self._post_receive(actions[i + 1])
            self._flush()
        for _, handle in self._sends:
            handle.wait()
        self._sends = []
        return float(sum(losses)) if losses else None

    def _forward(self, action: Action, batch, inputs: torch.Tensor | None) -> torch.Tensor | None:
        tokens, labels, *more = batch
        # a third element: the micro-batch's token layout (positions, documents; issue 31), which
        # every stage's chunks get
        layout = dict(layout=more[0]) if more and more[0] is not None else {}
        k, last = self._virtual(action), self.config.is_last(self.stage, action.chunk)
        if inputs is not None:
            inputs.requires_grad_(True)
        out = self.chunks[action.chunk](tokens, labels if last else None, hidden_states=inputs,
                                        **layout)
        if last:   # per-token loss [b, s] -> this micro-batch's share of the step's mean
            out = out.float().mean() / self.config.num_micro_batches
        else:
            self._send(out, "F", action.micro_batch, k + 1)
        self._held[(action.micro_batch, action.chunk)] = (inputs, out)
        return out.detach() if last else None

    def _set_loss_gradient(self, action: Action, batch) -> None:
        """Tell the chunk ``loss scale x w_i / m`` (module docstring) for its next backward: the
        gradient the objective gives micro-batch i's per-token losses, summed over its tokens.
        The engine multiplies the last chunk's loss by the same scale in its ``backward``."""
        scaler = getattr(self.engine, "scaler", None)
        scale = scaler.scale_tensor() if scaler is not None else 1.0   # a device tensor or 1.0
        weight = self.loss_weight(batch) if self.loss_weight is not None else 1.0
        g = torch.as_tensor(weight, dtype=torch.float32, device=self.state.device) * scale
        self.chunks[action.chunk].set_loss_gradient(
            (g / self.config.num_micro_batches).reshape(()))

    def _backward(self, action: Action, grad: torch.Tensor | None, extra) -> None:
        inputs, out = self._held.pop((action.micro_batch, action.chunk))
        roots, grads = [out], [grad]
        if extra is not None:   # the tied embedding's gradient from the last stage
            roots.append(extra[0])
            grads.append(extra[1])
        if grad is None:        # the loss: scaled by the engine
            if self.engine is not None:
                self.engine.backward(out)
            else:
                out.backward()
        elif self.engine is not None:
            self.engine.backward(roots, grads)
        else:
            torch.autograd.backward(roots, grads)
        k = self._virtual(action)
        if k > 0:
            self._send(inputs.grad, "B", action.micro_batch, k - 1)
            inputs.grad = None   # the send holds the gradient; the buffer is free again
            self._free["F"].append(inputs.detach())
        if grad is not None:
            self._free["B"].append(grad)
