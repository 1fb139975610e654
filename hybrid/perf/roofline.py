"""The GEMM roofline of a training step: the matrix products one rank executes and the time they
take at a measured rate (Megatron-LM, Narayanan et al. 2021, §5.1 / App. A for the FLOP count).

Pure arithmetic (docs/design.md §7); the rates come from :mod:`hybrid.perf.gemm_rate`.

One layer's forward on one of ``t`` TP ranks multiplies its T = b s tokens by four weight slices,
and the output layer by the vocab shard (``[m, k] @ [k, n]``, 2 m k n FLOPs each):

    qkv     [T, h] @ [h, (h + 2 g d)/t]         proj  [T, h/t] @ [h/t, h]
    fc1     [T, h] @ [h, f/t]  (2f/t SwiGLU)    fc2   [T, f/t] @ [f/t, h]
    logits  [T, h] @ [h, V/t]                   (once per micro-batch, after the last layer)

The backward repeats each with the same FLOPs in two other orientations: the input gradient
``[m, n] @ [n, k]`` and the weight gradient ``[k, m] @ [m, n]``. Full recompute reruns a layer's
forward GEMMs once more. Summed over GPT-2's shapes this is Megatron's 72 B s l h^2 (1 + V/(12 l h))
per iteration: its formula less the attention core's 12 B s^2 l h, which is not a weight GEMM.

A step's GEMM-bound time is sum(calls x FLOPs / rate) over these shapes; the step's fraction of the
roofline is that time over the step's measured time (1.0 = nothing but GEMMs, at their best rate).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.perf.architecture import GPT2, Architecture


@dataclass(frozen=True)
class Gemm:
    """``calls`` products ``[m, k] @ [k, n]`` per iteration on one rank."""

    name: str
    m: int
    k: int
    n: int
    calls: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.m, self.k, self.n)

    @property
    def flops(self) -> float:
        """FLOPs of all ``calls`` products."""
        return 2.0 * self.m * self.k * self.n * self.calls


def forward_gemms(tokens: int, hidden: int, vocab_padded: int, tp: int = 1, *,
                  heads: int | None = None, arch: Architecture = GPT2) -> list[Gemm]:
    """One call each of a layer's four forward GEMMs and the output layer's, on one TP rank."""
    h, f = hidden, arch.ffn(hidden)
    qkv = h + 2 * arch.kv_hidden(h, heads)
    fc1 = 2 * f if arch.swiglu else f
    for name, value in (("hidden", h), ("QKV width", qkv), ("MLP width", fc1),
                        ("padded vocab", vocab_padded)):
        if value % tp:
            raise ValueError(f"{name} {value} is not divisible by TP degree {tp}")
    return [Gemm("qkv", tokens, h, qkv // tp, 1), Gemm("proj", tokens, h // tp, h, 1),
            Gemm("fc1", tokens, h, fc1 // tp, 1), Gemm("fc2", tokens, f // tp, h, 1),
            Gemm("logits", tokens, h, vocab_padded // tp, 1)]


def training_gemms(*, micro_batch: int, seq: int, layers: int, hidden: int, vocab_padded: int,
                   tp: int = 1, micro_batches: int = 1, recomputed_layers: int = 0,
                   heads: int | None = None, arch: Architecture = GPT2,
                   logits: bool = True) -> list[Gemm]:
    """Every GEMM one rank runs in an iteration of ``micro_batches`` micro-batches: forward, input
    gradient (``.dgrad``) and weight gradient (``.wgrad``) of each shape, the layers' ``layers``
    times (plus ``recomputed_layers`` reruns of their forward), the output layer's once (``logits``
    False: a pipeline stage that does not hold it; ``layers`` is then the stage's)."""
    if not 0 <= recomputed_layers <= layers:
        raise ValueError(f"recomputed_layers must be in [0, {layers}], got {recomputed_layers}")
    out = []
    for g in forward_gemms(micro_batch * seq, hidden, vocab_padded, tp, heads=heads, arch=arch):
        if g.name == "logits" and not logits:
            continue
        per_batch = 1 if g.name == "logits" else layers
        forward = per_batch + (0 if g.name == "logits" else recomputed_layers)
        out += [Gemm(g.name, g.m, g.k, g.n, forward * micro_batches),
                Gemm(g.name + ".dgrad", g.m, g.n, g.k, per_batch * micro_batches),
                Gemm(g.name + ".wgrad", g.k, g.m, g.n, per_batch * micro_batches)]
    return out


def gemm_flops(gemms: list[Gemm]) -> float:
    return sum(g.flops for g in gemms)


def gemm_bound_seconds(gemms: list[Gemm], rates: dict[tuple[int, int, int], float]) -> float:
    """sum over the GEMMs of FLOPs / the measured FLOP/s of their shape."""
    missing = sorted({g.shape for g in gemms} - set(rates))
    if missing:
        raise ValueError(f"no measured GEMM rate for shapes {missing}")
    bad = {s: r for s, r in rates.items() if not r > 0}
    if bad:
        raise ValueError(f"GEMM rates must be positive FLOP/s, got {bad}")
    return sum(g.flops / rates[g.shape] for g in gemms)


def distinct_shapes(gemms: list[Gemm]) -> list[tuple[int, int, int]]:
    """The shapes to measure, each once, in order of first use."""
    return list(dict.fromkeys(g.shape for g in gemms))
