"""The run's layout: the parallel degrees and the batch arithmetic of one optimizer step.

Megatron-LM's rule (§3 "data parallel"; the pipeline terms: Narayanan et al. 2021 §2.2):

    world size           = TP t x CP c x PP p x DP d  ranks (their order: docs/design.md §2)
    c                    context-parallel ranks sharing each sample's sequence (issue 31): they read
                         the same samples, so the batch arithmetic counts DP d only
    global batch         = micro batch b x d x m      samples per optimizer step
    m                    micro-batches per step and DP rank: the gradient accumulation steps, and with
                         PP the micro-batches one run of the pipeline schedule carries
    v                    model chunks per pipeline stage (virtual pipeline, interleaved schedule)
    backwards per step   = m x v on every rank: what a ZeRO engine counts before it reduces over DP
    tokens per step      = global batch x sequence length

:class:`RunLayout` holds the degrees and counts and derives the rest; :meth:`RunLayout.for_world`
resolves it from the launched world size and the batch flags (the global batch defaults to one
micro-batch per DP rank) with messages that name the flag to change. Pure numbers: the trainer, the
ZeRO engine's accumulation count, the dry run and the performance models read one object instead of
each redoing the arithmetic. The pipeline's own rules (layers per chunk, m a multiple of p for the
interleaved schedule) stay with :class:`hybrid.pipeline.PipelineConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


class LayoutError(ValueError):
    """An invalid run layout; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class RunLayout:
    tensor_parallel: int = 1      # t, --tensor-model-parallel-size
    pipeline_parallel: int = 1    # p, --pipeline-model-parallel-size
    data_parallel: int = 1        # d = world / (t c p)
    micro_batch_size: int         # b, --micro-batch-size
    micro_batches: int = 1        # m per step and DP rank (gradient accumulation)
    model_chunks: int = 1         # v per pipeline stage (1: no virtual pipeline)
    seq_length: int               # s, --seq-length
    context_parallel: int = 1     # c, --context-parallel-size

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{f.name.replace('_', ' ')} must be a positive integer, got "
                                  f"{value!r}")
        if self.model_chunks > 1 and self.pipeline_parallel == 1:
            raise LayoutError(f"{self.model_chunks} model chunks per stage need pipeline "
                              f"parallelism; set --pipeline-model-parallel-size > 1 or drop "
                              f"--num-layers-per-virtual-pipeline-stage")

    @classmethod
    def for_world(cls, world_size: int, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                  micro_batch_size: int, global_batch: int | None = None, model_chunks: int = 1,
                  seq_length: int, context_parallel: int = 1) -> "RunLayout":
        """The layout of ``world_size`` ranks: d = world / (t c p), m = global batch / (b d);
        ``global_batch`` None is b d (one micro-batch per step)."""
        tp, pp, micro, cp = tensor_parallel, pipeline_parallel, micro_batch_size, context_parallel
        if cp > 1 and world_size % (tp * cp * pp):
            raise LayoutError(f"{world_size} ranks cannot be split into TP {tp} x CP {cp} x PP {pp} "
                              f"= {tp * cp * pp} ranks per data-parallel replica; launch a multiple "
                              f"of {tp * cp * pp} ranks or change --context-parallel-size")
        if world_size % (tp * pp):
            what = (f"TP groups of {tp}" if pp == 1 else
                    f"TP {tp} x PP {pp} = {tp * pp} ranks per data-parallel replica")
            raise LayoutError(f"{world_size} ranks cannot be split into {what}; launch a multiple "
                              f"of {tp * pp} ranks or change --tensor-model-parallel-size"
                              + (" / --pipeline-model-parallel-size" if pp > 1 else ""))
        dp = world_size // (tp * cp * pp)
        glob = global_batch if global_batch is not None else micro * dp
        if glob % (micro * dp):
            lower = (glob // (micro * dp)) * micro * dp
            raise LayoutError(
                f"global batch {glob} is not divisible by micro batch {micro} x data-parallel size "
                f"{dp} = {micro * dp}; set --global-batch-size to a multiple of {micro * dp} "
                f"(e.g. {max(lower, micro * dp)}) or change --micro-batch-size")
        return cls(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                   micro_batch_size=micro, micro_batches=glob // (micro * dp),
                   model_chunks=model_chunks, seq_length=seq_length, context_parallel=cp)

    @property
    def world_size(self) -> int:
        return (self.tensor_parallel * self.context_parallel * self.pipeline_parallel
                * self.data_parallel)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over all DP ranks."""
        return self.micro_batch_size * self.data_parallel * self.micro_batches

    @property
    def backwards_per_step(self) -> int:
        """Backward passes each rank runs per step: one per micro-batch and model chunk."""
        return self.micro_batches * self.model_chunks

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_length
