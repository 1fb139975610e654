"""The trainer's pipeline stage (Narayanan et al. 2021 §2.2): this rank's model chunks, the tied
embedding and the :class:`~hybrid.pipeline.PipelineRunner` that drives them, and the per-step
quantities the trainer reports.

With ``--pipeline-model-parallel-size p`` each rank builds the model chunks of its stage
(``GPTModel(layers=..., pre_process=..., post_process=...)``, one per virtual stage), shown to the ZeRO
engine and the checkpoints as one :class:`~hybrid.pipeline.StageChunks` whose parameter names are the
whole model's, so checkpoints reshard between PP degrees. A step is the runner's schedule over the m
micro-batches of this DP rank (the layout's m = global batch / (micro batch x DP)); the engine
counts m v backwards (``RunLayout.backwards_per_step``). Every stage of a PP column reads the same
micro-batches (they share the DP rank): the first stage uses the tokens, the last the labels and the
loss mask.

The loss mask reaches the last chunk through :class:`MaskedLoss`: the runner averages the per-token
values it returns, so it returns ``loss x mask x (tokens / kept tokens)``, whose mean is the masked
mean of the unpipelined trainer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.pipeline import PipelineConfig, PipelineRunner, StageChunks, TiedEmbedding

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MaskedLoss:
    """The last chunk, called with ``target`` = labels and loss mask stacked ([2, b, s] int64):
    per-token loss [b, s] scaled so that its mean is the mean over the kept tokens."""

    def __init__(self, chunk):
        self.chunk = chunk

    def __call__(self, tokens, target, hidden_states=None, **layout):
        """``layout``: ``layout=`` the micro-batch's TokenLayout, passed on to the chunk."""
        if target is None:
            return self.chunk(tokens, None, hidden_states=hidden_states, **layout)
        per_token = self.chunk(tokens, target[0], hidden_states=hidden_states, **layout)  # [b, s]
        mask = target[1].to(per_token.dtype)
        # a third row: the kept tokens of the WHOLE samples (context parallelism: this rank holds
        # a part of each sequence and returns its share of the loss, pretrain.token_split)
        kept = target[2].reshape(-1)[0].to(per_token.dtype) if target.size(0) > 2 else mask.sum()
        return per_token * mask * (mask.numel() / kept.clamp(min=1.0))

    @staticmethod
    def token_weight(batch) -> torch.Tensor:
        """The runner's ``loss_weight``: ``sum_t d(mean of the returned values) / d(loss_t)`` over
        the whole micro-batch = 1, or 0 when the mask keeps no token. Under CP a rank's tokens
        give only its share (its kept tokens over the whole samples' kept tokens, the third row);
        the aux losses take the whole micro-batch's value, the sum of every CP rank's share, as
        the single-stage probe does after its all-reduce over CP (models/gpt/moe.py)."""
        target = batch[1]
        kept = target[2].reshape(-1)[0] if target.size(0) > 2 else target[1].sum()
        return (kept > 0).to(torch.float32)

    @property
    def needs_loss_gradient(self) -> bool:
        return getattr(self.chunk, "needs_loss_gradient", False)

    def set_loss_gradient(self, value: torch.Tensor) -> None:
        self.chunk.set_loss_gradient(value)


@dataclass
class PipelineStage:
    """This rank's stage: ``model`` (its chunks as one module), ``tied`` (None on a middle stage or
    with untied embeddings) and ``runner`` (None until :func:`attach_runner` returns the stage
    with the runner over its engine)."""

    config: PipelineConfig
    chunks: list
    model: StageChunks
    tied: TiedEmbedding | None
    runner: PipelineRunner | None = None


def build_stage(pcfg: PipelineConfig, gcfg, state: ParallelState, *, sequence_parallel: bool,
                device, rng, plan, seed: int) -> PipelineStage:
    """The chunks of stage ``state.pp_rank`` in fp32 (initialised like the whole model: every
    parameter from its own name and ``seed``); ``plan``: the whole model's recompute plan or None,
    each chunk gets its layers' part."""
    from models.gpt.model import GPTModel
    chunks = []
    for c in range(pcfg.num_model_chunks):
        start, stop = pcfg.layer_range(state.pp_rank, c)
        chunk_plan = dataclasses.replace(plan, modes=plan.modes[start:stop]) if plan else None
        chunk = GPTModel(gcfg, state, sequence_parallel=sequence_parallel, device=device,
                         dtype=torch.float32, rng=rng, recompute=chunk_plan, layers=(start, stop),
                         pre_process=pcfg.is_first(state.pp_rank, c),
                         post_process=pcfg.is_last(state.pp_rank, c))
        chunk.init_weights(seed)
        chunks.append(chunk)
    tied = None
    if not gcfg.untie_embeddings_and_output_weights:
        if state.is_first_stage:
            tied = TiedEmbedding(state, lambda: chunks[0].embedding.word.weight)
        elif state.is_last_stage:
            tied = TiedEmbedding(state, lambda: chunks[-1].output_weight)
    return PipelineStage(pcfg, chunks, StageChunks(chunks), tied)


def attach_runner(stage: PipelineStage, engine, state: ParallelState, *, precision: str,
                  micro_batch: int, seq_length: int, hidden: int,
                  sequence_parallel: bool) -> PipelineStage:
    """``stage`` with its runner over ``engine`` (the engine must exist: the runner tells it every
    backward); the last stage's copy of the tied embedding takes the engine's parameter dtype (the
    gradient and the weight travel in it)."""
    dtype = _DTYPES[precision]
    last = stage.chunks[-1]
    if last.output_weight is not None and stage.tied is not None:
        last.output_weight = last.output_weight.detach().to(dtype).requires_grad_()
    seq = seq_length // state.cp_size   # each CP rank's part of the sequence (issue 31)
    seq //= state.tp_size if sequence_parallel and state.tp_size > 1 else 1
    calls = [MaskedLoss(c) if stage.config.is_last(state.pp_rank, i) else c
             for i, c in enumerate(stage.chunks)]
    runner = PipelineRunner(state, stage.config, calls, activation_shape=(seq, micro_batch, hidden),
                            dtype=dtype, engine=engine, tied=stage.tied,
                            loss_weight=MaskedLoss.token_weight)
    return dataclasses.replace(stage, runner=runner)


def micro_batches(loader, m: int, device, state: ParallelState | None = None,
                  cp_comm_type: str = "p2p") -> list[tuple]:
    """The next ``m`` micro-batches of ``loader`` as the runner's (tokens, labels + loss mask);
    with ``state`` under context parallelism (or position / document ids in the batch) this
    rank's part of each, as (tokens, labels + loss mask + whole-sample kept tokens, TokenLayout)."""
    out = []
    for _ in range(m):
        batch = next(loader)
        if state is not None and (state.cp_size > 1 or batch.get("position_ids") is not None
                                  or batch.get("document_ids") is not None):
            from pretrain.token_split import split_micro_batch
            mb = split_micro_batch(batch, state, cp_comm_type, device)
            kept = mb.kept_tokens.to(mb.labels.dtype).expand_as(mb.labels)   # no host read
            target = torch.stack([mb.labels, mb.loss_mask.to(mb.labels.dtype), kept])
            out.append((mb.tokens, target, mb.layout))
            continue
        target = torch.stack([batch["labels"], batch["loss_mask"].to(batch["labels"].dtype)])
        out.append((batch["tokens"].to(device), target.to(device)))
    return out


def pipeline_bubble(stage: PipelineStage, output, state: ParallelState) -> torch.Tensor:
    """The measured bubble of the step: idle time over the pipeline's step time, averaged over the
    stages of this PP column (the quantity of (p - 1) / (v m + p - 1), hybrid.pipeline.schedules).
    Two control all-reduces over the PP group (the longest step in :meth:`PipelineRunner.bubble`,
    then the stages' bubbles), not in the comm ledger. A 0-dim float64 tensor on the device, never
    read here (issue 36: the trainer reads it once per log interval)."""
    total = stage.runner.bubble_tensor(output).reshape(1)
    with comm.unrecorded(state.pp):
        comm.all_reduce(total, state.pp)
    return total.reshape(()) / state.pp_size
