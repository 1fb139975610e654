"""The mixture-of-experts block of a GPT layer (issue 32): it replaces the dense MLP in the layers
that ``moe_layer_freq`` marks (Switch Transformer, GShard; Mixtral's SwiGLU experts; DeepSeekMoE's
and Qwen2-MoE's shared expert, Qwen2-MoE's sigmoid gate on it).

    x [s, b, h] ([s/tp, b, h] with SP)
      routed:  gather the sequence over TP (SP only) -> tokens [T = s b, h], the same on every TP
               rank -> router (fp32, hybrid/moe/router.py) -> dispatcher (sort by expert) ->
               grouped SwiGLU experts (TP-split, all-reduced: hybrid/moe/experts.py) -> combine
               weighted by the probabilities -> [s, b, h] -> this rank's sequence shard (SP)
      shared:  a dense SwiGLU MLP on x (column/row-parallel, SP as the dense layer), times
               sigmoid(x w_g) with the gate
      out = routed + shared

Under context parallelism (issue 31) the tokens are this CP rank's 2 of the 2C load-balanced chunks
of every sequence and are NOT gathered (that would undo CP's memory saving): routing is per token,
and the router reduces every statistic over the CP group instead (the balancing losses' counts,
the capacity: hybrid/moe/router.py), so a CP run routes, drops and balances exactly as CP 1. The
aux losses' gradient scale is then the whole micro-batch's, summed over CP in backward
(:func:`probe_loss_gradient`); the metrics count each micro-batch once over its C ranks.

Why gather under SP instead of routing the local shard: the routing is then over the same T tokens
as at TP 1, so capacity, the balancing losses and the dropped tokens are those of the single-device
oracle exactly. The gather's backward keeps this rank's slice (every TP rank computed the same full
gradient), and the experts' own ``f`` sums their partial input gradients first.

The balancing losses reach the gradient without changing the reported loss (Megatron's
``MoEAuxLossAutoScaler`` idea): :func:`attach_aux_loss` passes the layer output through unchanged
and gives the loss a gradient of ``d(training loss) / d(loss per token)`` summed over tokens, which
:class:`AuxLossScale` takes from the model's per-token loss in backward. So the aux loss is trained
as if added to every token's loss: loss scaling, gradient accumulation and the loss mask apply to it
exactly as to the language-model loss, and it works under activation recompute.

Under pipeline parallelism a stage without the output layer never sees the loss, so the schedule
sets the scale instead (:meth:`AuxLossScale.set`, reached through
``GPTModel.set_loss_gradient``): before each backward of micro-batch i the runner
(hybrid/pipeline/runner.py) computes ``loss scale x w_i / m`` on every stage, where m is the number
of micro-batches and ``w_i = sum_t d(micro-batch loss) / d(loss_t)`` (1 for a plain mean; the kept
fraction under a loss mask), which is what the probe would read on a single stage. Every stage
knows all three (the engine's scaler, the schedule, the micro-batch every stage of a PP column
reads), so the scale needs no message; Megatron-Core's ``MoEAuxLossAutoScaler.set_loss_scale``
does the same before backward. A scale set by the schedule wins over the probe, so every stage
(the last one included) uses the same value.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid import comm
from hybrid.comm import Group
from hybrid.moe.dispatch import LocalDispatcher, make_dispatcher
from hybrid.moe.experts import GroupedSwiGLUExperts
from hybrid.moe.router import Router
from hybrid.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, copy_to_tp,
                                    gather_sequence_replicated, scatter_to_sequence,
                                    set_tp_attributes)
from models.gpt.config import GPTConfig


class AuxLossScale:
    """The gradient one unit of aux loss gets: ``sum_t d(training loss) / d(loss_t)`` of the
    backward under way. Set by :func:`probe_loss_gradient` from the model's per-token loss (one
    stage), or by the pipeline schedule before each backward (:meth:`set`; module docstring)."""

    def __init__(self):
        self.value: torch.Tensor | None = None
        self.scheduled = False   # set by the schedule: the probe leaves it alone

    def set(self, value: torch.Tensor) -> None:
        """The scale of the next backward (a 0-dim fp32 tensor), from the pipeline schedule."""
        self.value, self.scheduled = value, True


class _ProbeLossGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, scale, cp):
        ctx.scale, ctx.cp = scale, cp
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.scale.scheduled:   # a pipeline runner that set the scale keeps it
            value = grad.float().sum()
            if ctx.cp is not None:   # the whole micro-batch's scale: every CP rank's tokens
                comm.all_reduce(value, ctx.cp)
            ctx.scale.value = value
        return grad, None, None


def probe_loss_gradient(loss: torch.Tensor, scale: AuxLossScale, cp: Group | None = None
                        ) -> torch.Tensor:
    """Identity on the per-token loss [b, s]; its backward records the scale for the aux losses.
    ``cp``: the CP group holding the rest of these sequences (one all-reduce of a scalar in
    backward: each CP rank's aux-loss share is scaled by the whole micro-batch's gradient)."""
    return _ProbeLossGradient.apply(loss, scale, cp if cp is not None and cp.size > 1 else None)


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        if ctx.scale.value is None:
            raise RuntimeError("the MoE aux loss has no gradient scale: the model's loss was not "
                               "computed in this backward and no pipeline schedule set it (run "
                               "pipeline stages through hybrid.pipeline.PipelineRunner, which "
                               "calls GPTModel.set_loss_gradient before each backward)")
        return grad, ctx.scale.value.to(grad.device).reshape(()), None


def attach_aux_loss(y: torch.Tensor, aux: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
    return _AttachAuxLoss.apply(y, aux, scale)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP of width fs (rows gate/up interleaved like the dense MLP), no biases."""

    def __init__(self, hidden: int, ffn: int, group: Group, sequence_parallel: bool, device, dtype):
        super().__init__()
        kw = dict(bias=False, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.fc1 = ColumnParallelLinear(hidden, 2 * ffn, group, **kw)
        self.fc2 = RowParallelLinear(ffn, hidden, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        gate, up = y.view(*y.shape[:-1], -1, 2).unbind(dim=-1)
        return self.fc2(F.silu(gate) * up)


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's gate ``sigmoid(x w)``, ``weight`` [1, h] replicated; under SP it sees a sequence
    shard, so it goes through ``f`` (its gradient summed over TP) and is marked like a LayerNorm."""

    def __init__(self, hidden: int, group: Group, sequence_parallel: bool, device, dtype):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(1, hidden, device=device, dtype=dtype))
        self._mark()

    def _mark(self) -> None:
        set_tp_attributes(self.weight, tensor_model_parallel=False, partition_dim=-1,
                          sequence_parallel=self.sequence_parallel)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._mark()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = copy_to_tp(self.weight, self.group) if self.sequence_parallel else self.weight
        return torch.sigmoid(F.linear(x, w))                                     # [s, b, 1]


class MoELayer(nn.Module):
    """The MoE block (module docstring), in place of ``mlp`` in a MoE layer; ``[s, b, h]`` in and
    out (sequence shards under SP). After each forward with autograd on it keeps detached metrics
    (see :meth:`pop_metrics`)."""

    def __init__(self, config: GPTConfig, group: Group, *, sequence_parallel: bool = False,
                 aux_scale: AuxLossScale | None = None, device=None, dtype=None,
                 ep: Group | None = None):
        super().__init__()
        h, e = config.hidden_size, config.num_experts
        # expert parallelism (hybrid/moe/dispatch.py): this rank holds experts
        # ep.rank * E/EP .. (ep.rank + 1) * E/EP - 1; the router still scores all E
        ep_size = ep.size if ep is not None else 1
        if e % ep_size:
            raise ValueError(f"{e} experts do not split evenly over expert-model-parallel size "
                             f"{ep_size}; choose an EP degree that divides {e}")
        self.group, self.sequence_parallel = group, sequence_parallel and group.size > 1
        self.aux_scale = aux_scale if aux_scale is not None else AuxLossScale()
        self.num_experts = e
        self.router = Router(h, e, config.moe_router_topk,
                             score_function=config.moe_router_score_function,
                             pre_softmax=config.moe_router_pre_softmax,
                             topk_scaling_factor=config.moe_router_topk_scaling_factor,
                             load_balancing_type=config.moe_router_load_balancing_type,
                             aux_loss_coeff=config.moe_aux_loss_coeff,
                             z_loss_coeff=config.moe_z_loss_coeff,
                             enable_expert_bias=config.moe_router_enable_expert_bias,
                             bias_update_rate=config.moe_router_bias_update_rate,
                             capacity_factor=config.moe_expert_capacity_factor,
                             device=device, dtype=dtype)
        set_tp_attributes(self.router.weight, tensor_model_parallel=False, partition_dim=-1)
        self.experts = GroupedSwiGLUExperts(e // ep_size, h, config.moe_ffn_hidden_size, group,
                                            device=device, dtype=dtype)
        self.dispatcher = (LocalDispatcher(e, dropless=config.moe_expert_capacity_factor is None)
                           if ep_size == 1 else
                           make_dispatcher(config.moe_token_dispatcher_type, e, ep))
        self.shared_expert = None
        self.shared_expert_gate = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_expert = SharedExpert(h, config.moe_shared_expert_intermediate_size, group,
                                              self.sequence_parallel, device, dtype)
            if config.moe_shared_expert_gate:
                self.shared_expert_gate = SharedExpertGate(h, group, self.sequence_parallel, device,
                                                           dtype)
        self._metrics = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        set_tp_attributes(self.router.weight, tensor_model_parallel=False, partition_dim=-1)
        return out

    def forward(self, x: torch.Tensor, layout=None) -> torch.Tensor:
        """``layout``: the forward's :class:`~models.gpt.token_layout.TokenLayout`; under CP its
        group is the one the router reduces its statistics over."""
        cp = layout.cp_group if layout is not None and layout.context_parallel else None
        tokens = x
        if self.sequence_parallel:
            tokens = gather_sequence_replicated(x, self.group)
        s, b, h = tokens.shape
        flat = tokens.reshape(s * b, h)                                            # [T, h]
        routing = self.router(flat, num_sequences=b, cp=cp)
        routed, counts = self.dispatcher.dispatch(flat, routing.expert_index, routing.probs)
        y = self.dispatcher.combine(self.experts(routed, counts)).view(s, b, h)    # [s, b, h]
        if self.sequence_parallel:
            y = scatter_to_sequence(y, self.group)
        y = self._attach_losses(y, routing)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * self.shared_expert_gate(x)
            y = y + shared
        if torch.is_grad_enabled():
            self._record(routing, cp.size if cp is not None else 1)
        return y

    @property
    def has_losses(self) -> bool:
        """Whether this layer trains an aux or z loss (which then needs :class:`AuxLossScale`)."""
        r = self.router
        return bool(r.load_balancing_type != "none" and r.aux_loss_coeff) or r.z_loss_coeff is not None

    def _attach_losses(self, y: torch.Tensor, routing) -> torch.Tensor:
        losses = [t for t in (routing.aux_loss, routing.z_loss) if t is not None]
        if not losses or not torch.is_grad_enabled():
            return y
        return attach_aux_loss(y, sum(losses), self.aux_scale)

    @torch.no_grad()
    def _record(self, routing, cp_size: int = 1) -> None:
        """Accumulate this micro-batch's load, losses and drops (device tensors, no host read).
        Under CP each rank holds its tokens' counts and loss shares, which add up over the CP
        group, and counts 1/C of the micro-batch."""
        zero = routing.load.new_zeros((), dtype=torch.float32)
        now = dict(load=routing.load.float(), dropped=routing.dropped.float(),
                   routes=zero + routing.expert_index.numel(),
                   aux_loss=routing.aux_loss.detach() if routing.aux_loss is not None else zero,
                   z_loss=routing.z_loss.detach() if routing.z_loss is not None else zero,
                   micro_batches=zero + 1 / cp_size)
        if self._metrics is None:
            self._metrics = now
        else:
            self._metrics = {k: v + now[k] for k, v in self._metrics.items()}

    def pop_metrics(self) -> dict[str, torch.Tensor] | None:
        """The metrics summed since the last call (None if no training forward ran): ``load`` [E]
        routes per expert (before dropping), ``dropped`` and ``routes`` counts, ``aux_loss`` and
        ``z_loss`` (times their coefficients) summed over ``micro_batches`` (this rank's tokens;
        under CP summing over the CP group, as pretrain.metrics does over DP x CP, gives the
        whole micro-batches')."""
        out, self._metrics = self._metrics, None
        return out
