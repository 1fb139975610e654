"""Tensor-parallel GPT (Megatron-LM §3; ZeRO paper §10 trains this model at 1.5B-170B), GPT-2 by
default and Llama-style with the options of :class:`~models.gpt.config.GPTConfig`.

    tokens [b, s] -> word (vocab-parallel) (+ learned position) embeddings -> dropout   [s, b, h]
                  -> num_layers x TransformerLayer (models/gpt/layer.py)       [s, b, h]
                  -> final norm -> logits = h @ E_r^T (this rank's vocab rows)  [s, b, V_p/tp]
                  -> vocab-parallel cross-entropy over the true vocab         [s, b] -> loss [b, s]

With labels the last two steps are one operation (:mod:`hybrid.tensor_parallel.linear_cross_entropy`:
the loss's gradient with respect to the logits is formed in forward, over the logits' own buffer);
without labels the model returns the logits.

E is the word embedding (tied, GPT-2) or, with ``untie_embeddings_and_output_weights``, a separate
vocab-parallel ``output_layer`` (Llama). Rotary positions live in the attention (no parameters).

The output layer never gathers the logits: ``copy_to_tp`` (Megatron's ``f``) in front of the tied
matmul makes the backward sum the input gradient over TP, and the cross-entropy all-reduces only three
numbers per token. With sequence parallelism activations between the TP blocks are sequence shards
``[s/tp, b, h]``; the embedding reduce-scatters and the output layer all-gathers instead.

Pipeline stages (Megatron's ``pre_process`` / ``post_process``): ``layers=(start, stop)`` builds only
those transformer layers (named by their global index, so checkpoints and the canonical layout are
unchanged), ``pre_process`` the embedding in front of them and ``post_process`` the final norm, the
output layer and the loss after them. A stage without the embedding takes ``hidden_states``
``[s(/tp), b, h]`` and, without the output layer, returns them. A last stage that is not also the
first keeps its own copy of the tied word embedding (``output_weight``, a leaf tensor outside
``parameters()``): the first stage owns and trains it, the pipeline sends the copy's gradient there
and the updated weight back (:mod:`hybrid.pipeline.tied`).

Build on ``device="meta"`` (nothing allocated), then :meth:`GPTModel.init_weights` materialises each
parameter from its canonical full value (:func:`models.gpt.sharding.canonical_init`) and keeps this
rank's shard, so every TP degree and the single-device reference start identical.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.checkpoint.state import ParamLayout
from hybrid.parallel_state import ParallelState
from hybrid.recompute import RecomputePlan, Recomputer
from hybrid.tensor_parallel import (RNGTracker, VocabParallelEmbedding, VocabParallelOutput,
                                    column_parallel_linear, copy_to_tp, linear_cross_entropy,
                                    set_tp_attributes)
from hybrid.zero.results import Fragment, copy_overlaps
from models.gpt.config import GPTConfig
from models.gpt.kv_cache import KVCache
from models.gpt.layer import TransformerLayer, build_norm, dropout
from models.gpt.moe import AuxLossScale, MoELayer, probe_loss_gradient
from models.gpt.sharding import (WORD_EMBEDDING, canonical_init, checkpoint_layout, expert_slice,
                                 gather_canonical, gather_experts, shard_tensor)
from models.gpt.token_layout import TokenLayout


class PositionEmbedding(nn.Module):
    """Learned positions ``[max_positions, h]``, replicated on every TP rank."""

    def __init__(self, max_positions: int, hidden: int, sequence_parallel: bool, device, dtype):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(max_positions, hidden, device=device, dtype=dtype))
        self._mark()

    def _mark(self) -> None:
        set_tp_attributes(self.weight, tensor_model_parallel=False, partition_dim=-1,
                          sequence_parallel=self.sequence_parallel)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._mark()  # to()/to_empty() may replace the Parameter object and drop its attributes
        return out


class GPTEmbedding(nn.Module):
    """Word (+ learned position) embeddings and embedding dropout: tokens [b, s] -> [s, b, h]
    ([s/tp, b, h] SP)."""

    def __init__(self, config: GPTConfig, state: ParallelState, sequence_parallel: bool, rng,
                 device, dtype):
        super().__init__()
        self.group, self.sequence_parallel, self.rng = state.tp, sequence_parallel, rng
        self.p = config.hidden_dropout
        self.word = VocabParallelEmbedding(config.padded_vocab_size(state.tp_size), config.hidden_size,
                                           state.tp, reduce_scatter_output=sequence_parallel,
                                           device=device, dtype=dtype)
        self.position = None   # rotary positions are applied in the attention
        if config.position_embedding_type == "learned_absolute":
            self.position = PositionEmbedding(config.max_position_embeddings, config.hidden_size,
                                              sequence_parallel, device, dtype)

    def forward(self, tokens: torch.Tensor, start: int = 0,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``start``: position of the first token (after a KV cache's positions); ``positions``:
        each token's position, [b, s] or [s] (a :class:`~models.gpt.token_layout.TokenLayout`'s),
        instead of ``start ..``."""
        x = self.word(tokens.t())                                   # [s, b, h] or [s/tp, b, h]
        if self.position is not None:
            if positions is None:
                x = self._add_positions(x, tokens.size(1), start)
            else:
                x = self._add_gathered_positions(x, positions)
        return dropout(x, self.p, self.training, self.rng, self.sequence_parallel, self.group.size)

    def _add_gathered_positions(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of the position table gathered per token (issue 31: positions that restart at
        each document, or a CP rank's global indices)."""
        weight = self.position.weight                               # [max_positions, h]
        ids = positions.t() if positions.dim() == 2 else positions[:, None]   # [s, b] or [s, 1]
        if self.sequence_parallel:
            # replicated weight used by one sequence shard: f sums its gradient over TP
            weight = copy_to_tp(weight, self.group)
            chunk = ids.size(0) // self.group.size
            ids = ids[self.group.rank * chunk:(self.group.rank + 1) * chunk]   # [s/tp, b]
        return x + F.embedding(ids, weight)                         # [s(/tp), b or 1, h]

    def _add_positions(self, x: torch.Tensor, s: int, start: int) -> torch.Tensor:
        pos = self.position.weight[start:start + s]                 # [s, h]
        if self.sequence_parallel:
            # replicated weight applied to one sequence shard: f sums its gradient over TP
            pos = copy_to_tp(pos, self.group)
            chunk = s // self.group.size
            pos = pos[self.group.rank * chunk:(self.group.rank + 1) * chunk]  # [s/tp, h]
        return x + pos.unsqueeze(1)


class LayerRange(nn.ModuleList):
    """Transformer layers ``start .. start + len - 1`` of the whole model, registered under their
    global index (``layers.<global index>.*``) so parameter names are the same in every stage."""

    def __init__(self, modules=(), start: int = 0):
        super().__init__()
        self.start = start
        for i, module in enumerate(modules):
            self.add_module(str(start + i), module)

    def _get_abs_string_index(self, idx):
        return str(int(super()._get_abs_string_index(idx)) + self.start)


class GPTModel(nn.Module):
    """GPT-2 over the TP group of ``state`` (see the module docstring).

    ``device="meta"`` builds without storage (call :meth:`init_weights` or hand it to ZeRO stage 3);
    any other device (default ``state.device``) materialises at once with seed 0 - call
    ``init_weights(seed)`` for another seed. ``sequence_parallel`` needs the sequence length to be a
    multiple of the TP degree and is ignored at TP 1. ``rng`` is required for dropout at TP > 1.
    ``recompute`` (a :class:`~hybrid.recompute.RecomputePlan`) checkpoints layers per the plan (for
    a pipeline stage: a plan of this stage's layers). ``layers``, ``pre_process``, ``post_process``:
    a pipeline stage (module docstring).
    """

    def __init__(self, config: GPTConfig, state: ParallelState, *, sequence_parallel: bool = False,
                 device=None, dtype: torch.dtype = torch.float32, rng: RNGTracker | None = None,
                 recompute: RecomputePlan | None = None, layers: tuple[int, int] | None = None,
                 pre_process: bool = True, post_process: bool = True):
        super().__init__()
        config.validate_for_tp(state.tp_size)
        start, stop = layers if layers is not None else (0, config.num_layers)
        if not 0 <= start <= stop <= config.num_layers:
            raise ValueError(f"layer range ({start}, {stop}) is not inside the model's "
                             f"{config.num_layers} layers")
        self.pre_process, self.post_process = pre_process, post_process
        self.config, self.state, self.rng = config, state, rng
        self.group = state.tp
        self.sequence_parallel = sequence_parallel and state.tp_size > 1
        self.device = torch.device(device) if device is not None else state.device
        sp = self.sequence_parallel
        # Built on meta, then materialised once by init_weights: no throw-away initialisation.
        meta = dict(device="meta", dtype=dtype)
        self.embedding = GPTEmbedding(config, state, sp, rng, **meta) if pre_process else None
        self.aux_scale = AuxLossScale()   # the gradient scale of the MoE layers' aux losses
        self.layers = LayerRange(
            (TransformerLayer(config, state.tp, sequence_parallel=sp, rng=rng, **meta,
                              moe=config.is_moe_layer(i), aux_scale=self.aux_scale,
                              ep=getattr(state, "ep", None))
             for i in range(start, stop)), start)
        self.final_norm = build_norm(config, state.tp, sp, **meta) if post_process else None
        self.output_layer = None   # tied: the logits use the word embedding
        self.output_weight = None   # the last stage's copy of the tied embedding (docstring)
        if post_process and config.untie_embeddings_and_output_weights:
            self.output_layer = VocabParallelOutput(
                config.hidden_size, config.padded_vocab_size(state.tp_size), state.tp,
                sequence_parallel=sp, **meta)
        elif post_process and not pre_process:
            self.output_weight = torch.empty(config.padded_vocab_size(state.tp_size) // state.tp_size,
                                             config.hidden_size, device="meta", dtype=dtype)
        self.recomputer = None   # activation recompute (hybrid/recompute); None keeps everything
        if recompute is not None:
            self.recomputer = Recomputer(recompute, state.tp, sequence_parallel=sp, rng=rng,
                                         device=state.device)
            self.recomputer.check_layers(stop - start)
            for i, layer in enumerate(self.layers):
                layer.attn.recompute_core = recompute.selective(i)
        if self.device.type != "meta":
            self.init_weights(0)

    # ---- construction ----------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Materialise every parameter on ``self.device`` with its shard of the canonical initial
        value for ``seed`` (one full tensor in memory at a time)."""
        if self.device.type == "meta":
            self.device = self.state.device
        if self.device.type == "meta":
            return   # a dry-run state: shapes only, no values to compute
        if any(p.is_meta for p in self.parameters()):
            self.to_empty(device=self.device)
        for name, p in self.named_parameters():
            p.copy_(self.init_parameter(name, seed))
        for moe in self.moe_layers():
            moe.router.reset_buffers(self.device)
        if self.output_weight is not None:
            self.output_weight = self.init_parameter(WORD_EMBEDDING, seed).to(
                self.device, self.output_weight.dtype).requires_grad_()

    def init_parameter(self, name: str, seed: int) -> torch.Tensor:
        """This rank's TP shard of parameter ``name``'s canonical initial value (what ZeRO stage 3
        partitions further without ever materialising the whole model)."""
        full = expert_slice(name, canonical_init(self.config, name, seed), *self._ep_position())
        return shard_tensor(self.config, name, full, self.state.tp_rank, self.state.tp_size)

    @torch.no_grad()
    def load_canonical_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full canonical (reference-layout) state dict, keeping this rank's shards."""
        missing = sorted(set(dict(self.named_parameters())) - set(state_dict))
        if missing:
            raise KeyError(f"canonical state dict lacks {missing[:4]} ({len(missing)} missing)")
        tp_rank, tp = self.state.tp_rank, self.state.tp_size
        for name, p in self.named_parameters():
            full = expert_slice(name, state_dict[name], *self._ep_position())
            p.copy_(shard_tensor(self.config, name, full, tp_rank, tp))

    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """The full reference-layout state dict, gathered over TP and, for the experts, over EP
        (every TP and EP rank must call)."""
        out = gather_canonical(self.config, dict(self.named_parameters()), self.group)
        ep = getattr(self.state, "ep", None)
        return gather_experts(out, ep) if ep is not None else out

    def _ep_position(self) -> tuple[int, int]:
        """(EP rank, EP size) of this rank: which slice of the experts it holds."""
        ep = getattr(self.state, "ep", None)
        return (ep.rank, ep.size) if ep is not None else (0, 1)

    # ---- the checkpoint state protocol (hybrid.checkpoint.state.CheckpointState) ------------
    optimizer_state_replicated = True   # a model holds no optimizer state: nothing to save twice
    parameters_replicated = True        # trained without ZeRO stage 3, every DP rank holds them
    state_replica = 0                   # (replicated state: only DP rank 0 writes it)

    def checkpoint_layout(self) -> dict[str, ParamLayout]:
        """Where each TP-local parameter sits in its full tensor (what a checkpoint piece records)."""
        ep = getattr(self.state, "ep", None)   # experts split over EP (issue 32)
        return checkpoint_layout(self.config, dict(self.named_parameters()), self.state.tp_size,
                                 ep.size if ep is not None else 1)

    def checkpoint_pieces(self) -> list[Fragment]:
        """This rank's whole TP-local parameters as ``model`` pieces (views: filled in place)."""
        return [Fragment(name, "model", 0, p.data.view(-1)) for name, p in self.named_parameters()]

    def checkpoint_counters(self) -> dict:
        return {}

    @torch.no_grad()
    def load_checkpoint_pieces(self, pieces: list[Fragment], counters: dict) -> None:
        copy_overlaps(self.checkpoint_pieces(), pieces)

    def sharding_units(self) -> list[nn.Module]:
        """Submodules that ZeRO stage 3 gathers one at a time, in forward order."""
        units = (self.embedding, *self.layers, self.final_norm, self.output_layer)
        return [u for u in units if u is not None]

    @property
    def tied_sharding_units(self) -> list[int]:
        """Indices of sharding units used again after the last one: the word embedding when its
        weight is the output layer's (ZeRO stage 3 must gather it again for the logits)."""
        tied = self.output_layer is None and self.pre_process and self.post_process
        return [0] if tied else []

    # ---- forward ---------------------------------------------------------------------------
    def new_kv_cache(self, max_len: int | None = None) -> KVCache:
        """An empty key/value cache for incremental decoding (models/gpt/kv_cache.py), up to
        ``max_len`` positions (default: the model's max positions)."""
        if self.sequence_parallel:
            raise ValueError("KV-cache decoding runs one token at a time, which sequence parallelism "
                             "cannot split; build the model with sequence_parallel=False to generate")
        if not (self.pre_process and self.post_process):
            raise ValueError("KV-cache decoding needs the whole model; build it without pipeline stages")
        return KVCache(self.config.num_layers, max_len or self.config.max_position_embeddings)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None, *,
                cache: KVCache | None = None, layout: TokenLayout | None = None) -> torch.Tensor:
        """tokens [b, s] int64 -> per-token loss [b, s] (fp32) given labels [b, s], else this rank's
        vocab-parallel logits [b, s, V_padded/tp] (columns >= vocab_size are padding). A pipeline
        stage without the embedding starts from ``hidden_states``; one without the output layer
        returns its last layer's output [s(/tp), b, h]. With ``cache`` (:meth:`new_kv_cache`) the
        tokens continue the cached positions, and their keys and values are added to it.
        ``layout`` (:class:`~models.gpt.token_layout.TokenLayout`): the tokens' positions, documents
        and context-parallel placement (issue 31), for the embedding and every layer; every stage
        of a pipeline gets the same one."""
        if layout is not None and layout.is_plain():
            layout = None   # the default path, unchanged
        if cache is not None:
            if layout is not None:
                raise ValueError("KV-cache decoding takes no TokenLayout (positions follow the cache)")
            return self._forward_cached(tokens, cache)
        self._check_input(tokens, labels)
        if layout is not None:
            layout.check(*tokens.shape, self.config.max_position_embeddings
                         if self.check_ids and self.config.position_embedding_type ==
                         "learned_absolute" else None)
        if self.pre_process:
            positions = layout.positions() if layout is not None else None
            x = self.embedding(tokens, positions=positions)         # [s, b, h] ([s/tp, b, h] SP)
        elif hidden_states is None:
            raise ValueError("this pipeline stage has no embedding: pass hidden_states")
        else:
            x = hidden_states
        # the layers' extra arguments (cache, start, layout); none on the default path
        extra = () if layout is None else (None, 0, layout)
        if self.recomputer is not None:
            x = self.recomputer.run(self.layers, x, *extra)         # checkpointed per the plan
        else:
            for layer in self.layers:
                x = layer(x, *extra)
        if not self.post_process:
            return x                                                # [s(/tp), b, h]
        x = self.final_norm(x)
        if labels is None:
            return self._output_logits(x).transpose(0, 1).contiguous()  # [b, s, V_p/tp]
        loss = self._output_loss(x, labels.t()).t().contiguous()    # [b, s]
        if self.moe_layers():   # the MoE aux losses' gradient scale (models/gpt/moe.py)
            c = self.config   # summed over CP only when a balancing loss uses it
            losses = c.moe_z_loss_coeff is not None or (
                c.moe_router_load_balancing_type != "none" and bool(c.moe_aux_loss_coeff))
            loss = probe_loss_gradient(loss, self.aux_scale, layout.cp_group
                                       if layout is not None and losses else None)
        return loss

    def moe_layers(self) -> list[MoELayer]:
        """This stage's MoE blocks, in layer order."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoELayer)]

    @property
    def needs_loss_gradient(self) -> bool:
        """Whether a MoE layer of this chunk trains an aux or z loss: a pipeline runner then calls
        :meth:`set_loss_gradient` before each of its backwards."""
        return any(moe.has_losses for moe in self.moe_layers())

    def set_loss_gradient(self, value: torch.Tensor) -> None:
        """The pipeline schedule's ``sum_t d(step objective) / d(loss_t)`` over the tokens of the
        micro-batch whose backward comes next (0-dim fp32): the gradient scale of this chunk's
        MoE aux / z losses, which a stage without the loss cannot probe (models/gpt/moe.py)."""
        self.aux_scale.set(value)

    def update_expert_biases(self, dp_group) -> None:
        """DeepSeek-V3's aux-loss-free balancing: once per optimizer step, after it, move each
        router's expert bias by the loads of the global batch (summed over ``dp_group``, the
        data-parallel ranks). A no-op without ``moe_router_enable_expert_bias``."""
        for moe in self.moe_layers():
            moe.router.update_expert_bias(dp_group)

    def expert_biases(self) -> dict[int, torch.Tensor]:
        """The routers' expert-bias buffers by global layer index (empty without expert bias):
        training state outside the parameters, saved with checkpoints (pretrain/resume.py)."""
        out = {}
        for index, layer in zip(range(self.layers.start, self.layers.start + len(self.layers)),
                                self.layers):
            if isinstance(layer.mlp, MoELayer) and layer.mlp.router.expert_bias is not None:
                out[index] = layer.mlp.router.expert_bias
        return out

    def pop_moe_metrics(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per MoE layer (global index): the metrics summed since the last call
        (:meth:`models.gpt.moe.MoELayer.pop_metrics`)."""
        out = {}
        for index, layer in zip(range(self.layers.start, self.layers.start + len(self.layers)),
                                self.layers):
            if isinstance(layer.mlp, MoELayer):
                metrics = layer.mlp.pop_metrics()
                if metrics is not None:
                    out[index] = metrics
        return out

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits [b, s, V_p/tp] of tokens at positions ``cache.length ..`` (no recompute, no SP)."""
        self._check_input(tokens, None)
        cache.check_room(tokens.size(1))
        start = cache.length
        x = self.embedding(tokens, start)                           # [s, b, h]
        for layer, layer_cache in zip(self.layers, cache.layers):
            x = layer(x, layer_cache, start)
        cache.advance(tokens.size(1))
        return self._output_logits(self.final_norm(x)).transpose(0, 1).contiguous()

    def _output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Output layer, column-parallel over the vocab: [s(/tp), b, h] -> [s, b, V_p/tp]."""
        if self.output_layer is not None:
            return self.output_layer(x)
        # f (or g-bar with SP) then the GEMM, backward collective overlapped with the dW GEMM
        weight = self.embedding.word.weight if self.pre_process else self.output_weight
        return column_parallel_linear(x, weight, None, self.group,
                                      self.sequence_parallel)

    def _output_loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Output layer and cross-entropy in one: [s(/tp), b, h] and targets [s, b] -> loss [s, b]."""
        vocab_size = self.config.vocab_size
        if self.output_layer is not None:   # called as the module (ZeRO-3's hooks gather it)
            return self.output_layer(x, target, vocab_size)
        weight = self.embedding.word.weight if self.pre_process else self.output_weight
        return linear_cross_entropy(x, weight, target, self.group,
                                    sequence_parallel=self.sequence_parallel, vocab_size=vocab_size,
                                    check_ids=self.check_ids)

    check_ids = True   # the id range checks of _check_input and the layers (see below)

    def leave_id_checks_to_loader(self) -> None:
        """The training data loader checks every token id on the host before the copy
        (:func:`hybrid.data.loader.check_token_ids`): drop the model's and its layers' range
        checks, which read ``ids.min()`` / ``ids.max()`` (a host read per forward and a graph
        break under torch.compile; issue 36). Shape checks stay."""
        self.check_ids = False
        if self.pre_process:
            self.embedding.word.check_ids = False
        if self.output_layer is not None:
            self.output_layer.check_ids = False

    def _check_input(self, tokens: torch.Tensor, labels: torch.Tensor | None) -> None:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        s = tokens.size(1)
        if s > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {s} tokens is longer than max position embeddings "
                             f"{self.config.max_position_embeddings}; shorten it or raise "
                             f"--max-position-embeddings")
        if self.sequence_parallel and s % self.group.size:
            raise ValueError(f"sequence parallelism splits the sequence across {self.group.size} TP "
                             f"ranks, but the sequence has {s} tokens; use a multiple of "
                             f"{self.group.size}")
        if labels is not None and labels.shape != tokens.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of tokens "
                             f"{tuple(tokens.shape)}")
        if not self.check_ids:
            return
        for what, ids in (("token", tokens), ("label", labels)):
            # ids in the padding rows would silently train them; the check is free on the host only
            if ids is not None and ids.device.type == "cpu" and ids.numel() and (
                    int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
                raise ValueError(f"{what} ids must lie in [0, {self.config.vocab_size}) (the model's "
                                 f"vocab size); got [{int(ids.min())}, {int(ids.max())}] - does the "
                                 f"tokenizer match --vocab-size?")
