"""Memory, FLOPs and throughput models (ZeRO §3, §5-§7, §10; Megatron-LM; selective recompute).

Pure functions of numbers (docs/design.md §7), shared by the runtime's start-up memory report,
tools/paper_tables.py, tools/dry_run.py and the tests:

- :mod:`~hybrid.perf.model_states` - model-state bytes per device per ZeRO stage (Figure 1, Tables 1-2)
- :mod:`~hybrid.perf.activations`  - activation bytes per layer (with the attention core that runs:
  Megatron's explicit one, SDPA's flash kernels, the blocked CPU core), ZeRO-R checkpoints (Pa,
  Pa+cpu), buffers
- :mod:`~hybrid.perf.context_parallel` - context parallelism: the bytes a CP rank sends per layer and
  step for ring (p2p), all-to-all (a2a) and all-gather-KV attention, its tokens, the ring's working set
- :mod:`~hybrid.perf.architecture` - the model options that change the counts (GQA, SwiGLU, ...)
- :mod:`~hybrid.perf.flops`        - parameter counts and FLOPs per iteration
- :mod:`~hybrid.perf.memory`       - the sum of the above for one GPU of a run
- :mod:`~hybrid.perf.hardware`     - the cluster description (DGX-2 V100 by default)
- :mod:`~hybrid.perf.throughput`   - iteration time and TFLOP/s on that cluster (Figure 2)
- :mod:`~hybrid.perf.zeropp`       - stage 3 with ZeRO++ hpZ / qwZ / qgZ and hybrid sharding: DP
  traffic by link, its time, model states
- :mod:`~hybrid.perf.infinity`     - ZeRO-Infinity §3-§4: memory requirements, working memory
  (with tiling), arithmetic intensity and the bandwidth offloaded data needs for an efficiency
- :mod:`~hybrid.perf.roofline`     - the GEMMs of a step and its GEMM-bound time at measured rates
- :mod:`~hybrid.perf.gemm_rate`    - those rates, measured on this machine once and cached (torch)
- :mod:`~hybrid.perf.tiling`       - ZeRO-3's gathered working memory per layer with and without
  memory-centric tiling (ZeRO-Infinity), and the tile factor a budget needs
"""

from hybrid.perf.activations import (activation_bytes_per_layer, checkpoint_bytes,
                                     constant_buffer_bytes, fused_gradient_buffer_bytes,
                                     logits_bytes, zero_paper_activation_bytes)
from hybrid.perf.architecture import GPT2, Architecture
from hybrid.perf.flops import (flops_per_gpu, gpt_param_count, megatron_param_count,
                               model_flops_per_iteration, pad_vocab, recompute_flops_per_iteration)
from hybrid.perf.hardware import Cluster, dgx2_v100_cluster
from hybrid.perf.memory import MemoryEstimate, device_memory
from hybrid.perf.model_states import (GB, STAGE_NAMES, ModelStateBytes, bytes_per_param,
                                      dp_communication_elements, max_params_for_memory,
                                      model_state_bytes)
from hybrid.perf.throughput import (IterationEstimate, ThroughputAssumptions,
                                    attention_core_flops_per_iteration,
                                    elementwise_elements_per_layer, estimate_iteration,
                                    sustained_efficiency, tp_ring_bytes_per_microbatch)

__all__ = [
    "GPT2", "Architecture",
    "activation_bytes_per_layer", "checkpoint_bytes", "constant_buffer_bytes",
    "fused_gradient_buffer_bytes", "logits_bytes", "zero_paper_activation_bytes", "flops_per_gpu",
    "gpt_param_count", "megatron_param_count", "model_flops_per_iteration", "pad_vocab",
    "recompute_flops_per_iteration", "Cluster", "dgx2_v100_cluster", "MemoryEstimate", "device_memory", "GB", "STAGE_NAMES", "ModelStateBytes",
    "bytes_per_param", "dp_communication_elements", "max_params_for_memory", "model_state_bytes",
    "IterationEstimate", "ThroughputAssumptions", "estimate_iteration", "sustained_efficiency",
    "tp_ring_bytes_per_microbatch", "attention_core_flops_per_iteration",
    "elementwise_elements_per_layer",
]
