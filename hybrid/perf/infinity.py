"""The ZeRO-Infinity paper's memory and bandwidth analysis (Rajbhandari et al., SC'21, arXiv
2104.07857, §3 "Memory requirements" and §4 "Bandwidth requirements"; issue 35, part 2).

Pure functions of numbers (docs/design.md §7), shared by tools/infinity_tables.py (the paper's
Table 1 and Figure 3, docs/paper/zero-infinity.md), the dry run and the layout chooser. Notation of
the paper: nl layers, hd hidden size, bsz sequences per GPU, seq sequence length, ci checkpoint
interval (transformer blocks between two activation checkpoints), attn_heads heads.

Memory (§3), in bytes:

    parameters                      12 nl hd^2        (QKV hd x 3hd, projection hd x hd, MLP 2 x hd x 4hd)
    model states                    20 per parameter = 240 nl hd^2 (fp16 parameter and gradient,
                                    fp32 master, momentum, variance and gradient)
    activation checkpoints          2 bsz seq hd nl / ci
    model-state working memory      4 hd x 4hd         (the largest operator, hd -> 4hd: its
                                    parameters and gradients, 4 bytes per element together)
    activation working memory       bsz seq ci (16 hd + 2 attn_heads seq)   (Equation 5: the
                                    activations recomputed between two checkpoints)

Bandwidth (§4): with peak_tp the achievable peak FLOP/s of a GPU, bw the bandwidth of a kind of
data and ait its arithmetic intensity (FLOPs per byte moved),

    efficiency = ait bw / (ait bw + peak_tp)

    computation per iteration       2 x 4 x bsz seq params   (forward, backward twice, recompute)
    ait of parameters and gradients seq bsz        (4 x 2 params bytes: loaded for forward,
                                                    recompute and backward; gradients stored once)
    ait of optimizer states         seq bsz / 4    (2 x 16 params bytes: read and written once)
    ait of activation checkpoints   24 hd ci       (4 nl / ci hd seq bsz bytes: written, read back)

With memory-centric tiling (paper §5.1.3, issue 35 part 1) an operator split into T tiles keeps
one tile's parameters and gradients at a time: the model-state working memory is divided by T
(:func:`working_memory_bytes` with ``tile_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.perf.architecture import GPT2, Architecture

MODEL_STATE_BYTES_PER_PARAM = 20    # §3: fp16 param + grad (4), fp32 master, m, v, grad (16)
OPTIMIZER_STATE_BYTES_PER_PARAM = 16
WORKING_BYTES_PER_ELEMENT = 4       # §3: the operator's fp16 parameters and gradients together
PAPER_PEAK_FLOPS = 70e12            # §4.2 / Figure 3: achievable single-GPU peak (V100, 70 TFLOP/s)

KINDS = ("params_grads", "optimizer_states", "activation_checkpoints")


def transformer_params(layers: int, hidden: int) -> float:
    """12 nl hd^2: the four linear layers of each transformer block (§3)."""
    _positive(layers=layers, hidden=hidden)
    return 12.0 * layers * hidden * hidden


def model_state_bytes(params: float, bytes_per_param: int = MODEL_STATE_BYTES_PER_PARAM) -> float:
    """Model states of the whole model (§3): 20 bytes per parameter with gradient accumulation's
    fp32 gradients (240 nl hd^2 for a transformer); pass 16 for ZeRO's K = 12 accounting."""
    if not params > 0:
        raise ValueError(f"parameter count must be positive, got {params!r}")
    return bytes_per_param * params


def checkpoint_bytes(batch: int, seq: int, hidden: int, layers: int, ci: int = 1) -> float:
    """Activation checkpoints (§3): one fp16 bsz x seq x hd input every ci blocks."""
    _positive(batch=batch, seq=seq, hidden=hidden, layers=layers, ci=ci)
    return 2.0 * batch * seq * hidden * layers / ci


def activation_working_bytes(batch: int, seq: int, hidden: int, heads: int, ci: int = 1) -> float:
    """Activation working memory (§3, Equation 5): the activations of the ci blocks between two
    checkpoints, recomputed before their backward: bsz seq ci (16 hd + 2 attn_heads seq) bytes."""
    _positive(batch=batch, seq=seq, hidden=hidden, heads=heads, ci=ci)
    return float(batch) * seq * ci * (16 * hidden + 2 * heads * seq)


def activation_bytes(batch: int, seq: int, hidden: int, heads: int, layers: int) -> float:
    """Activations of every block without checkpoints: nl times one block's working memory."""
    _positive(layers=layers)
    return layers * activation_working_bytes(batch, seq, hidden, heads, ci=1)


def working_memory_bytes(largest_operator_params: float, *, tile_factor: int = 1,
                         bytes_per_element: int = WORKING_BYTES_PER_ELEMENT) -> float:
    """Model-state working memory: the parameters and gradients of the largest operator gathered at
    once (§3), one of ``tile_factor`` tiles with memory-centric tiling (§5.1.3)."""
    _positive(tile_factor=tile_factor, bytes_per_element=bytes_per_element)
    if not largest_operator_params > 0:
        raise ValueError(f"largest operator size must be positive, got {largest_operator_params!r}")
    return bytes_per_element * largest_operator_params / tile_factor


def largest_gather(params, tile_factor: int = 1) -> tuple[str, float]:
    """(name, elements) of the largest piece gathered at once from ``params``, an iterable of
    (name, elements, tileable): under memory-centric tiling a tileable parameter (a linear layer's
    weight) is gathered one of ``tile_factor`` tiles at a time, the others whole."""
    _positive(tile_factor=tile_factor)
    best = max(((name, n / tile_factor if tileable else float(n)) for name, n, tileable in params),
               key=lambda item: item[1], default=None)
    if best is None:
        raise ValueError("no parameters: the model has nothing to gather")
    return best


def gpt_largest_parameter(hidden: int, vocab_padded: int, *, tp: int = 1, heads: int | None = None,
                          arch: Architecture = GPT2) -> tuple[str, float]:
    """(name, elements) of the largest parameter one TP rank of a GPT holds: the word embedding
    (V / t x h), the fused QKV (h x (h + 2 g d) / t) or the MLP's input weight (h x f / t; gate and
    up fused with SwiGLU) - the piece ZeRO-3 gathers whole without tiling."""
    _positive(hidden=hidden, vocab_padded=vocab_padded, tp=tp)
    h, f = hidden, arch.ffn(hidden)
    return max((("word embedding", vocab_padded * h / tp),
                ("QKV", h * (h + 2 * arch.kv_hidden(h, heads)) / tp),
                ("MLP input", h * f * (2 if arch.swiglu else 1) / tp)), key=lambda item: item[1])


def paper_working_memory_bytes(hidden: int, tile_factor: int = 1) -> float:
    """§3's model-state working memory of a transformer: the hd -> 4hd linear, 4 x hd x 4hd bytes
    (divided by the tile factor with tiling)."""
    _positive(hidden=hidden)
    return working_memory_bytes(4.0 * hidden * hidden, tile_factor=tile_factor)


def flops_per_iteration(batch: int, seq: int, params: float) -> float:
    """§4.1: 2 x 4 x bsz x seq x params (forward, backward = 2 forwards, one recompute forward)."""
    _positive(batch=batch, seq=seq)
    return 8.0 * batch * seq * params


def arithmetic_intensity(kind: str, *, batch: int, seq: int, hidden: int = 1, ci: int = 1) -> float:
    """FLOPs per byte moved of one kind of data (§4.1): params_grads seq bsz, optimizer_states
    seq bsz / 4, activation_checkpoints 24 hd ci."""
    _positive(batch=batch, seq=seq, hidden=hidden, ci=ci)
    if kind == "params_grads":
        return float(seq * batch)
    if kind == "optimizer_states":
        return seq * batch / 4.0
    if kind == "activation_checkpoints":
        return 24.0 * hidden * ci
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


def efficiency(ait: float, bandwidth: float, peak_flops: float = PAPER_PEAK_FLOPS) -> float:
    """§4: ait bw / (ait bw + peak_tp), the share of the step spent computing when the data
    movement does not overlap compute."""
    if not (ait > 0 and bandwidth >= 0 and peak_flops > 0):
        raise ValueError(f"need ait > 0, bandwidth >= 0, peak > 0; got {ait}, {bandwidth}, {peak_flops}")
    return ait * bandwidth / (ait * bandwidth + peak_flops)


def required_bandwidth(ait: float, target: float, peak_flops: float = PAPER_PEAK_FLOPS) -> float:
    """Bytes/s the efficiency formula needs for ``target`` efficiency: target peak / (ait (1 - target))."""
    if not 0 < target < 1:
        raise ValueError(f"target efficiency must lie strictly between 0 and 1, got {target!r}")
    if not (ait > 0 and peak_flops > 0):
        raise ValueError(f"need ait > 0 and peak > 0; got {ait}, {peak_flops}")
    return target * peak_flops / (ait * (1 - target))


def partitioned_param_bandwidth(per_gpu_link: float, gpus: int, gpu_gpu_bandwidth: float) -> float:
    """Bandwidth-centric partitioning (§6.1): each of ``gpus`` GPUs reads 1/gpus of a parameter over
    its own PCIe link, then all-gathers over the GPU interconnect, so a GPU sees
    min(gpus x link, GPU-GPU bandwidth) for parameters (one link when one GPU owns the whole
    parameter, as ZeRO-Offload's broadcast does)."""
    _positive(gpus=gpus)
    return min(gpus * per_gpu_link, gpu_gpu_bandwidth)


@dataclass(frozen=True)
class OffloadNeed:
    """One kind of offloaded data of a run: the bandwidth the step needs per GPU for the target
    efficiency against the bandwidth the host gives it."""

    kind: str
    ait: float
    required: float     # bytes/s per GPU
    available: float    # bytes/s per GPU
    peak_flops: float

    @property
    def efficiency(self) -> float:
        """§4's efficiency at the available bandwidth."""
        return efficiency(self.ait, self.available, self.peak_flops)

    @property
    def sufficient(self) -> bool:
        return self.available >= self.required


def offload_needs(*, micro_batch: int, seq: int, hidden: int, dp: int, peak_flops: float,
                  target: float, optimizer_bandwidth: float | None = None,
                  param_bandwidth: float | None = None, checkpoint_bandwidth: float | None = None,
                  ci: int = 1) -> list[OffloadNeed]:
    """The §4 requirement of each offloaded kind of data (None: that kind stays on the device).

    The optimizer states of a GPU are its 1/dp ZeRO partition while its computation is the whole
    model's on its micro-batch, so their intensity per GPU is dp times §4's seq bsz / 4 (the paper's
    per-model requirement compared with the aggregate bandwidth of dp GPUs is the same number).
    Parameters and gradients are gathered whole for compute: their intensity stays seq bsz, and the
    bandwidth to compare is :func:`partitioned_param_bandwidth`'s."""
    needs = []
    for kind, available, scale in (("params_grads", param_bandwidth, 1),
                                   ("optimizer_states", optimizer_bandwidth, dp),
                                   ("activation_checkpoints", checkpoint_bandwidth, 1)):
        if available is None:
            continue
        ait = scale * arithmetic_intensity(kind, batch=micro_batch, seq=seq, hidden=hidden, ci=ci)
        needs.append(OffloadNeed(kind, ait, required_bandwidth(ait, target, peak_flops), available,
                                 peak_flops))
    return needs


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
