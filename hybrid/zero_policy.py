"""What ZeRO runs under a parallel layout, what it refuses, and its shared numbers: one definition.

A leaf module (layer 0 of docs/design.md §Architecture, like :mod:`hybrid.adamw_config`): the ZeRO
engines' factory and config (:mod:`hybrid.zero`), the performance model (:mod:`hybrid.perf`, which
may not import hybrid.zero), the training config, dry run and traffic report (:mod:`pretrain`) and
the tools all read these, so they agree on the stage a layout runs, on the layouts refused and the
message, and on the default gradient bucket.

- :func:`stage_with_pipeline` - the stage the engine runs for a requested stage and PP degree;
- :func:`layout_refusal` - why a (stage, PP degree) is refused, or None; :func:`check_layout` raises it;
- :data:`DEFAULT_BUCKET_ELEMENTS` - the gradient bucket (ZeRO-R CB) of the engine, the training
  config and the memory model;
- :data:`QUANT_BLOCK`, :data:`QUANT_SCALE_BYTES` - the int8 block format of ZeRO++ qwZ / qgZ
  (:mod:`hybrid.zero.quantize`), which the traffic model (:mod:`hybrid.perf.zeropp`) counts.
"""

from __future__ import annotations

# Elements per gradient bucket (constant-size buffer, ZeRO-R §6.3): 2e8, DeepSpeed's usual setting
# and the one the perf model's tables, layout rankings and their tests were built on (ZeRO-R's
# buffers: 2 x 2e8 16-bit elements = 0.8 GB per GPU). A bucket never outgrows the model (a smaller
# model gets one bucket of its own size, hybrid.zero.partition), so small runs are unaffected;
# stage 2 keeps a staging bucket of this size, so a run short of memory lowers --zero-bucket-size.
DEFAULT_BUCKET_ELEMENTS = 200_000_000

QUANT_BLOCK = 256        # elements per int8 quantization block (ZeRO++ uses a few hundred to thousands)
QUANT_SCALE_BYTES = 4    # one fp32 scale per block

STAGE2_AS_STAGE1_NOTE = (
    "ZeRO stage 2 with pipeline parallelism runs as stage 1: the gradients of the step's "
    "micro-batches accumulate in a full-size buffer and are reduce-scattered once, after the last "
    "backward (stage 2 would reduce in each of the m backwards, m times the DP traffic)")

ZERO3_WITH_PIPELINE = (
    "ZeRO stage 3 with pipeline parallelism is not supported (--zero-stage 3 with "
    "--pipeline-model-parallel-size > 1): stage 3 all-gathers a stage's parameters over DP in every "
    "micro-batch's forward and again in its backward, so with m micro-batches per step it would "
    "gather them 2m times instead of twice (2m gathers: m x the 3-Psi volume of ZeRO section 7), or "
    "hold them gathered across the whole schedule and lose the memory saving (DeepSpeed refuses it "
    "too); use --zero-stage 1 or 2 with pipeline parallelism")


def stage_with_pipeline(stage: int, pp_size: int) -> int:
    """The stage an engine runs under pipeline parallelism: stage 2 runs as stage 1 when
    ``pp_size > 1``.

    With PP a stage's parameters get m (m v when interleaved) backwards per step, and gradients
    must be reduced once per step, after the last of them, across DP only (Megatron's distributed
    optimizer; ``torch.distributed.pipelining`` syncs FSDP2's gradients in the last backward only).
    Stage 2 (ZeRO §5.2) keeps no full-size gradient, so it could only reduce in every backward: m
    times its DP volume. Accumulating over the micro-batches needs the full-size gradient stage 1
    keeps, so stage 2 becomes stage 1 (same 2Ψ DP volume, once per step; the gradient memory of
    stage 1). DeepSpeed refuses ZeRO-2 with pipeline parallelism instead. Stages 0, 1 and 3 are
    unchanged (stage 3 with PP is refused: :func:`layout_refusal`).
    """
    return 1 if stage == 2 and pp_size > 1 else stage


def layout_refusal(stage: int, pp_size: int) -> str | None:
    """Why ZeRO ``stage`` cannot run with ``pp_size`` pipeline stages (the message names the fix),
    or None when it can."""
    return ZERO3_WITH_PIPELINE if stage == 3 and pp_size > 1 else None


def check_layout(stage: int, pp_size: int) -> int:
    """The stage the engine runs for ``stage`` under ``pp_size`` pipeline stages; ValueError with
    :func:`layout_refusal`'s message for a refused layout."""
    refusal = layout_refusal(stage, pp_size)
    if refusal is not None:
        raise ValueError(refusal)
    return stage_with_pipeline(stage, pp_size)


def runnable_stages(pp_size: int) -> tuple[int, ...]:
    """The distinct stages an engine runs under ``pp_size`` pipeline stages (refused ones left out):
    the stages worth estimating for a layout search."""
    return tuple(sorted({stage_with_pipeline(s, pp_size) for s in range(4)
                         if layout_refusal(s, pp_size) is None}))
