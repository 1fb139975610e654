"""Configuration of ZeRO-DP (ZeRO paper §5 stages, §6.3 constant-size buffers).

:class:`ZeroConfig` picks the stage (0 = plain data parallel, 1 = Pos, 2 = Pos+g, 3 = Pos+g+p), the
precision of parameters and gradients (fp32, or bf16/fp16 with an fp32 master copy, mixed-precision
training of Micikevicius et al. 2018 as used in ZeRO §3.1), the constant bucket size of gradient
communication (CB of ZeRO-R: independent of the model size) and dynamic loss scaling for fp16.
Two ZeRO++ options (off by default) quantize communication to block-wise int8
(:mod:`hybrid.zero.quantized_collectives`): ``quantized_weights`` (qwZ) stage 3's parameter
all-gathers, ``quantized_gradients`` (qgZ) the gradient reduce-scatter of stages 1-3, done inside
each host first and then across hosts. Master weights and optimizer states stay exact.
Both dataclasses validate themselves with messages that name the fix. AdamW's hyper-parameters
are :class:`hybrid.adamw_config.AdamWConfig` (a leaf module: the offload backends read it too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybrid.muon_config import MuonConfig
from hybrid.precision_config import LossScaleConfig
from hybrid.zero_policy import DEFAULT_BUCKET_ELEMENTS

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}



@dataclass
class ZeroConfig:
    """What ZeRO partitions and how it communicates.

    ``bucket_size`` is in elements (constant, ZeRO-R CB): gradients are reduced, and stage 1/2
    parameters all-gathered, one bucket at a time. ``gradient_accumulation_steps`` tells stages 0
    and 1 which ``backward`` is the last micro-batch (they communicate only then); stage 2 reduces
    every micro-batch, as it keeps no full gradient (with pipeline parallelism it runs as stage 1:
    :func:`hybrid.zero_policy.stage_with_pipeline`). How the DP collectives travel is the
    parallel state's choice (``--dp-transport``, :mod:`hybrid.parallel_state`), not the engine's.

    Topology-aware options (past the paper; :mod:`hybrid.zero.host_groups`): ``hybrid_shard``
    partitions the model states of stages 1-3 over the DP ranks of one host and keeps one copy per
    host (FSDP2's HSDP, MiCS); ``hpz`` gives stage 3 a secondary 16-bit partition inside the host,
    so the backward's parameter all-gather stays inside it (ZeRO++ hpZ).
    """

    stage: int = 0
    precision: str = "fp32"
    bucket_size: int = DEFAULT_BUCKET_ELEMENTS
    overlap_communication: bool = True
    gradient_accumulation_steps: int = 1
    clip_grad: float = 0.0
    stage3_prefetch: bool = True
    stage3_param_persistence_threshold: int = 0
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    alignment_bytes: int = 16  # every partition chunk starts on this boundary (GPU vector loads)
    hybrid_shard: bool = False   # partition inside a host, replicate across hosts (FSDP2 HSDP, MiCS)
    hpz: bool = False            # stage 3: secondary 16-bit partition inside the host (ZeRO++ hpZ)
    quantized_weights: bool = False     # qwZ: stage 3 all-gathers int8 parameters (ZeRO++ §3.1)
    quantized_weights_format: str = "int8"   # qwZ's payload: int8 | fp8 (E4M3, same blocks)
    quantized_gradients: bool = False   # qgZ: hierarchical int8 gradient reduce-scatter (§3.3)
    # stages 0-2: weight-gradient GEMMs and the embedding's lookup accumulate straight into the
    # gradient buffer or staging bucket (hybrid.tensor_parallel.grad_fusion); False: autograd's
    grad_accumulation_fusion: bool = True
    # stage 3, memory-centric tiling (ZeRO-Infinity, hybrid.zero.tiling): linear weights split
    # into this many row tiles, each its own sharding unit; and the bound (bytes) on the
    # parameters one unit gathers at once, None: no bound
    tile_factor: int = 1
    max_working_memory: int | None = None
    # --optimizer muon: Muon for the hidden matrices, AdamW for the rest (hybrid.zero.muon)
    muon: MuonConfig | None = None


    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3 (0 = plain data parallel), got "
                             f"{self.stage!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if int(self.bucket_size) < 1:
            raise ValueError(f"bucket_size is a number of elements >= 1, got {self.bucket_size}")
        self.bucket_size = int(self.bucket_size)
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got "
                             f"{self.gradient_accumulation_steps}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad is a maximum global norm (0 = off), got {self.clip_grad}")
        if self.stage3_param_persistence_threshold < 0:
            raise ValueError("stage3_param_persistence_threshold is a number of elements >= 0")
        if self.hybrid_shard and self.stage == 0:
            raise ValueError("--zero-hybrid-shard partitions ZeRO's model states inside each host; "
                             "stage 0 partitions nothing: use --zero-stage 1, 2 or 3 with it")
        if self.hpz and self.stage != 3:
            raise ValueError(f"--zero-hpz keeps a secondary partition of stage 3's parameters; "
                             f"ZeRO stage {self.stage} does not partition parameters: use "
                             f"--zero-stage 3 with it")
        if self.hpz and self.hybrid_shard:
            raise ValueError("--zero-hpz and --zero-hybrid-shard together: hybrid sharding already "
                             "gathers parameters inside the host only, a secondary partition would "
                             "add memory and save nothing; choose one")
        if self.alignment_bytes < 1 or self.alignment_bytes & (self.alignment_bytes - 1):
            raise ValueError(f"alignment_bytes must be a power of two, got {self.alignment_bytes}")
        if self.quantized_weights and self.stage != 3:
            raise ValueError(f"--zero-quantized-weights quantizes the parameter all-gathers of ZeRO "
                             f"stage 3 (stages 0-2 keep whole parameters and gather none per "
                             f"layer); use --zero-stage 3 or drop the flag (got stage {self.stage})")
        if self.quantized_weights_format not in ("int8", "fp8"):
            raise ValueError(f"--zero-quantized-weights-format must be int8 or fp8, got "
                             f"{self.quantized_weights_format!r}")
        if self.quantized_weights_format != "int8" and not self.quantized_weights:
            raise ValueError(f"--zero-quantized-weights-format {self.quantized_weights_format} is "
                             f"the format of --zero-quantized-weights' all-gathers: add that flag")
        if self.quantized_gradients and self.hybrid_shard:
            raise ValueError("--zero-quantized-gradients with --zero-hybrid-shard: hybrid sharding "
                             "reduce-scatters inside the host and only all-reduces a shard across "
                             "hosts, which qgZ's int8 reduce-scatter does not cover; choose one")
        if self.quantized_gradients and self.stage == 0:
            raise ValueError("--zero-quantized-gradients quantizes the gradient reduce-scatter of "
                             "ZeRO stages 1-3; stage 0 all-reduces whole gradients instead. Use "
                             "--zero-stage 1, 2 or 3, or drop the flag")

        if int(self.tile_factor) != self.tile_factor or self.tile_factor < 1:
            raise ValueError(f"--tile-factor is a number of tiles >= 1 (1 = no tiling), got "
                             f"{self.tile_factor!r}")
        if self.tile_factor > 1 and self.stage != 3:
            raise ValueError(f"--tile-factor {self.tile_factor} tiles the weights ZeRO stage 3 "
                             f"gathers one unit at a time; ZeRO stage {self.stage} keeps every "
                             f"parameter whole: use --zero-stage 3 or drop the flag")
        if self.max_working_memory is not None and self.max_working_memory <= 0:
            raise ValueError(f"--max-working-memory must be a positive size, got "
                             f"{self.max_working_memory!r}")
        if self.max_working_memory is not None and self.stage != 3:
            raise ValueError(f"--max-working-memory bounds the parameters ZeRO stage 3 gathers per "
                             f"unit; ZeRO stage {self.stage} keeps every parameter whole: use "
                             f"--zero-stage 3 or drop the flag")

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the model's parameters and gradients (the '16-bit' copies of the paper)."""
        return PRECISIONS[self.precision]

    @property
    def mixed_precision(self) -> bool:
        """True when an fp32 master copy is kept beside 16-bit parameters."""
        return self.precision != "fp32"

    @property
    def alignment_elements(self) -> int:
        return max(1, self.alignment_bytes // torch.empty((), dtype=self.param_dtype).element_size())
