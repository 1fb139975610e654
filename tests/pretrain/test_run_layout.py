"""hybrid.layout.RunLayout: the derived values of a few layouts against hand-computed ones, and its
errors."""

import pytest

from hybrid.layout import LayoutError, RunLayout
from pretrain.arguments import parse_args


@pytest.mark.parametrize("world, tp, pp, micro, glob, chunks, seq, expected", [
    # DP only, the default global batch: d = 4, m = 1, one backward per step
    (4, 1, 1, 2, None, 1, 16, dict(data_parallel=4, micro_batches=1, global_batch=8,
                                   backwards_per_step=1, tokens_per_step=128)),
    # TP 2 x DP 4 with accumulation: 48 = 4 x 4 x 3
    (8, 2, 1, 4, 48, 1, 64, dict(data_parallel=4, micro_batches=3, global_batch=48,
                                 backwards_per_step=3, tokens_per_step=3072)),
    # PP 4 interleaved (v 2) x DP 2: m = 8 / (1 x 2) = 4, m v = 8 backwards per stage
    (8, 1, 4, 1, 8, 2, 64, dict(data_parallel=2, micro_batches=4, global_batch=8,
                                backwards_per_step=8, tokens_per_step=512)),
    # the GPT-3 175B layout: TP 8 x PP 16 x DP 8 = 1024 GPUs, batch 1536 of b 1, v 3
    (1024, 8, 16, 1, 1536, 3, 2048, dict(data_parallel=8, micro_batches=192, global_batch=1536,
                                         backwards_per_step=576, tokens_per_step=3145728)),
])
def test_derived_values(world, tp, pp, micro, glob, chunks, seq, expected):
    layout = RunLayout.for_world(world, tensor_parallel=tp, pipeline_parallel=pp,
                                 micro_batch_size=micro, global_batch=glob, model_chunks=chunks,
                                 seq_length=seq)
    assert {k: getattr(layout, k) for k in expected} == expected
    assert layout.world_size == world


def test_the_config_resolves_it():
    cfg, _ = parse_args(["--world-size", "8", "--num-layers", "8", "--pipeline-model-parallel-size",
                         "4", "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size",
                         "1", "--global-batch-size", "8", "--seq-length", "64"])
    assert cfg.validate_for_world(8) == RunLayout(pipeline_parallel=4, data_parallel=2,
                                                  micro_batch_size=1, micro_batches=4,
                                                  model_chunks=2, seq_length=64)


def test_errors_name_the_fix():
    with pytest.raises(LayoutError, match="6 ranks cannot be split into TP 2 x PP 2 = 4 ranks per "
                                          "data-parallel replica"):
        RunLayout.for_world(6, tensor_parallel=2, pipeline_parallel=2, micro_batch_size=1,
                            seq_length=8)
    with pytest.raises(LayoutError, match=r"global batch 10 is not divisible by micro batch 2 x "
                                          r"data-parallel size 2 = 4; set --global-batch-size to a "
                                          r"multiple of 4 \(e.g. 8\)"):
        RunLayout.for_world(2, micro_batch_size=2, global_batch=10, seq_length=8)
    with pytest.raises(LayoutError, match="2 model chunks per stage need pipeline parallelism"):
        RunLayout(micro_batch_size=1, model_chunks=2, seq_length=8)
    with pytest.raises(LayoutError, match="micro batches must be a positive integer, got 0"):
        RunLayout(micro_batch_size=1, micro_batches=0, seq_length=8)
    with pytest.raises(LayoutError, match="seq length must be a positive integer, got True"):
        RunLayout(micro_batch_size=1, seq_length=True)
