"""Block-wise symmetric int8 quantization of the ZeRO++ communication options (qwZ, qgZ).

ZeRO++ (Wang et al. 2023, §3.1 qwZ and §3.3 qgZ) sends parameters and gradients as int8 with one
scale per block of consecutive elements instead of one per tensor, so an outlier only coarsens its
own block. Here a block is :data:`BLOCK` = 256 elements and the quantization is symmetric:

    scale = max(|x| over the block) / 127        (fp32, one per block)
    q     = round(x / scale), in [-127, 127]     (int8)
    x'    = q * scale,  so  |x - x'| <= scale / 2 for every element of the block.

A row of S elements (the last block may be short) travels as ONE int8 buffer, the payload followed
by the scales' bytes, so a collective moves it in one message:

    packed row [S + 4 * ceil(S / BLOCK)]  =  q [S]  |  scales [ceil(S / BLOCK)] as fp32 bytes

which is 1 + 4/256 bytes per element: 1.97x fewer than bf16/fp16, 3.94x fewer than fp32.

With ``fmt="fp8"`` (``--zero-quantized-weights-format fp8``, qwZ only) the payload is E4M3
(``torch.float8_e4m3fn``, 1 byte) with the same blocks and fp32 scales, so the bytes on the wire
are the same; only the rounding differs:

    scale = max(|x| over the block) / 448       (448: E4M3's largest value)
    q     = e4m3(x / scale)                      (round to nearest; 3 mantissa bits)
    x'    = q * scale,  so  |x - x'| <= max(|x| / 16, scale / 1024) for every element.

int8 spends its 8 bits uniformly over [-max, max] (an absolute error of max/254); E4M3 keeps a
relative error of 1/16 down to max/2^15 of the block's maximum, so small weights beside a large
one keep their leading digits (FP8 training's weights are cast to E4M3 again anyway).

A block holding an Inf or NaN dequantizes to NaN everywhere, so an overflow is still seen after the
collective (the engine's non-finite check and fp16's loss scaler rely on it).

Tensor parallelism: a rank's flat chunk interleaves TP-sharded parameters with TP-replicated ones
(LayerNorm, row-parallel biases, position embeddings), at the same offsets on every TP rank. A block
mixing both would get a different scale on each TP rank and round the replicated values
differently, so the TP copies would drift apart step after step. ``agree`` (the engines pass the
maximum over the TP group, :func:`~hybrid.zero.quantized_collectives.tp_agreed_scales`) makes
every TP rank use the same scale per block: a replicated value, equal on all of them, then
quantizes to the same int8 everywhere.

Pure tensor code, vectorised over rows and blocks: the same on CPU and CUDA.
"""

from __future__ import annotations

import torch

from hybrid.zero_policy import QUANT_BLOCK as BLOCK, QUANT_SCALE_BYTES as SCALE_BYTES

QMAX = 127           # symmetric int8 range [-127, 127]
FORMATS = ("int8", "fp8")
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0     # E4M3's largest finite value


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def packed_numel(numel: int) -> int:
    """int8 elements (bytes) of one packed row of ``numel`` values: payload plus scales."""
    return numel + SCALE_BYTES * num_blocks(numel)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def quantize(x: torch.Tensor, agree=None, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [P, S] (any float dtype) -> (q [P, S] int8 (``fmt="fp8"``: float8_e4m3fn),
    scales [P, ceil(S/BLOCK)] fp32). ``agree(scales)``, if given, replaces the scales in place by
    ones every TP rank shares."""
    _check_format(fmt)
    rows, numel = x.shape
    nb = num_blocks(numel)
    padded = torch.zeros(rows, nb * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :numel] = x
    blocks = padded.view(rows, nb, BLOCK)                               # [P, nb, BLOCK]
    # a divisor on x's device: CUDA multiplies by the reciprocal of a Python-number divisor, which
    # rounds differently from CPU's true division now and then (issue 19: bytes must agree)
    top = QMAX if fmt == "int8" else _FP8_MAX
    scales = blocks.abs().amax(dim=2) / blocks.new_full((), top)        # [P, nb]; NaN/Inf stay
    if agree is not None:   # a NaN scale becomes Inf first, which a maximum cannot lose
        agree(torch.nan_to_num_(scales, nan=float("inf")))
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero block: q = 0
    q = blocks / divisor.unsqueeze(2)
    if fmt == "int8":
        q = torch.round(q)
    q = torch.nan_to_num_(q.clamp_(-top, top), nan=0.0)                 # the scale carries the NaN
    return q.view(rows, nb * BLOCK)[:, :numel].to(torch.int8 if fmt == "int8" else _FP8), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q [P, S] int8 or float8_e4m3fn, scales [P, nb] fp32) -> values [P, S] fp32. A non-finite
    scale (its block held an Inf or NaN) makes the whole block NaN."""
    rows, numel = q.shape
    per_element = scales.repeat_interleave(BLOCK, dim=1)[:, :numel]     # [P, S]
    values = q.to(torch.float32) * per_element
    return torch.where(torch.isfinite(per_element), values, torch.full_like(values, float("nan")))


def pack(x: torch.Tensor, agree=None, fmt: str = "int8") -> torch.Tensor:
    """Rows ``x`` [P, S] -> packed int8 rows [P, packed_numel(S)] (payload | scale bytes); an fp8
    payload travels as its bytes."""
    rows, numel = x.shape
    q, scales = quantize(x, agree, fmt)
    out = torch.empty(rows, packed_numel(numel), dtype=torch.int8, device=x.device)
    out[:, :numel] = q.view(torch.int8)
    out[:, numel:] = scales.contiguous().view(torch.int8)               # [P, 4 nb] raw bytes
    return out


def unpack(packed: torch.Tensor, numel: int, fmt: str = "int8") -> torch.Tensor:
    """Packed int8 rows [P, packed_numel(numel)] -> dequantized values [P, numel] fp32."""
    _check_format(fmt)
    rows = packed.shape[0]
    if packed.shape[1] != packed_numel(numel):
        raise ValueError(f"a packed row of {numel} values has {packed_numel(numel)} bytes, got "
                         f"{packed.shape[1]}")
    nb = num_blocks(numel)
    raw = torch.empty(rows, SCALE_BYTES * nb, dtype=torch.int8, device=packed.device)
    scales = raw.copy_(packed[:, numel:]).view(torch.float32)           # [P, nb], 4-byte aligned
    payload = packed[:, :numel]
    if fmt == "fp8":   # the same bytes read as E4M3 (a copy: a view needs a contiguous row)
        payload = payload.contiguous().view(_FP8)
    return dequantize(payload, scales)
