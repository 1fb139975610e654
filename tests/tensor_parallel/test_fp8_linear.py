"""FP8 linear layers (hybrid/tensor_parallel/fp8_linear.py, docs/fp8.md) on CPU, where torch's
``_scaled_mm`` runs float8 GEMMs too.

* The scales each recipe hands to the GEMMs equal a hand computation (448 / amax, 57344 / amax for
  E5M2 gradients, per-row / per-column powers of two for rowwise, the amax history for delayed).
* Forward and backward equal a quantize-dequantize reference written here in fp64 (the only
  difference left is the output's one rounding), for every recipe and both formats.
* Column- and row-parallel fp8 linears at TP 2 (with and without sequence parallelism) equal the
  single-device fp8 linear: the TP group's amax maximum makes every rank cast as one device would.
"""

from __future__ import annotations

import pytest
import torch

import hybrid.tensor_parallel.fp8_linear as fp8_linear_module
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import ColumnParallelLinear, RowParallelLinear, scatter_to_sequence
from hybrid.tensor_parallel.fp8_linear import Fp8Scaling, fp8_linear
from hybrid.tensor_parallel.fp8_scaling import Fp8Recipe
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Recorder:
    """Wraps fp8_linear.scaled_mm: records (a dtype, b dtype, scale_a, scale_b) per GEMM."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = fp8_linear_module.scaled_mm

        def record(a, b, sa, sb, out_dtype):
            self.calls.append((a.dtype, b.dtype, sa.clone(), sb.clone()))
            return original(a, b, sa, sb, out_dtype)
        monkeypatch.setattr(fp8_linear_module, "scaled_mm", record)


def _run(recipe, x, w, g):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    scaling = Fp8Scaling(recipe)
    y = fp8_linear(x, w, None, scaling)
    y.backward(g)
    return y, x.grad, w.grad, scaling


# ---- scales against a hand computation ---------------------------------------------------------
X = torch.tensor([[1.0, -3.0, 0.5, 0.25], [0.5, 2.0, -0.125, 1.0]])       # [M=2, K=4]
W = torch.tensor([[0.5, 0.25, -1.0, 0.0], [2.0, 0.0, 0.0, -0.5],
                  [0.0, 0.75, 0.0, 0.0]])                                  # [N=3, K=4]
G = torch.tensor([[1.0, -4.0, 0.5], [8.0, 0.25, -2.0]])                   # [M=2, N=3]


def _f32(v):
    return torch.tensor(v, dtype=torch.float64).to(torch.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_tensorwise_scales_are_max_over_amax(monkeypatch, fmt):
    rec = _Recorder(monkeypatch)
    _run(Fp8Recipe(format=fmt, recipe="tensorwise"), X, W, G)
    grad_max, grad_dtype = (57344.0, E5M2) if fmt == "hybrid" else (448.0, E4M3)
    (fa, fb, sx, sw), (ga, gb, sg, sw2), (ga2, gx, sg2, sx2) = rec.calls   # Y, dX, dW
    assert (fa, fb) == (E4M3, E4M3) and (ga, gb) == (grad_dtype, E4M3) and gx == E4M3
    assert sx == _f32(448.0 / 3.0) and sw == _f32(448.0 / 2.0)            # amax 3 and 2
    assert sg == _f32(grad_max / 8.0) and sg2 == sg and sw2 == sw and sx2 == sx


def test_rowwise_scales_are_per_row_and_column_powers_of_two(monkeypatch):
    rec = _Recorder(monkeypatch)
    _run(Fp8Recipe(format="hybrid", recipe="rowwise"), X, W, G)
    (_, _, sx, sw), (_, _, sg, swc), (_, _, sgc, sxc) = rec.calls

    def pow2(maximum, amaxes):   # largest power of two <= maximum / amax
        return torch.tensor([2.0 ** torch.floor(torch.log2(torch.tensor(maximum / a,
                                                                       dtype=torch.float64)))
                             for a in amaxes], dtype=torch.float32)
    assert torch.equal(sx.view(-1), pow2(448, [3.0, 2.0]))                 # X per row, [M, 1]
    assert torch.equal(sw.view(-1), pow2(448, [1.0, 2.0, 0.75]))           # W per output row
    assert sx.shape == (2, 1) and sw.shape == (1, 3)
    assert torch.equal(sg.view(-1), pow2(57344, [4.0, 8.0]))               # dY per row (dX GEMM)
    assert torch.equal(swc.view(-1), pow2(448, [2.0, 0.75, 1.0, 0.5]))     # W per column
    assert torch.equal(sgc.view(-1), pow2(57344, [8.0, 4.0, 2.0]))         # dY per column (dW)
    assert torch.equal(sxc.view(-1), pow2(448, [1.0, 3.0, 0.5, 1.0]))      # X per column
    assert sgc.shape == (3, 1) and sxc.shape == (1, 4)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scales_come_from_the_amax_history(monkeypatch, algo):
    rec = _Recorder(monkeypatch)
    recipe = Fp8Recipe(format="e4m3", recipe="delayed", amax_history_len=3, amax_compute_algo=algo)
    scaling = Fp8Scaling(recipe)
    amaxes = [3.0, 6.0, 1.5, 0.75]          # X scaled so that its amax is each of these in turn
    for a in amaxes:
        x = (X * (a / 3.0)).requires_grad_()
        fp8_linear(x, W.clone().requires_grad_(), None, scaling).backward(G)
    used = [call[2] for call in rec.calls[0::3]]            # the forward GEMM's input scale
    # call 0: an empty history -> its own amax; then the history of the earlier calls (window 3)
    expected = [3.0, 3.0, 6.0, 6.0] if algo == "max" else [3.0, 3.0, 6.0, 1.5]
    assert [u.item() for u in used] == [_f32(448.0 / e).item() for e in expected]
    assert scaling.amax_history[0].tolist() == [0.75, 1.5, 6.0]             # newest first
    assert scaling.amax_history[1].tolist() == [2.0, 2.0, 2.0]              # the weight's
    assert scaling.amax_history[2].tolist() == [8.0, 8.0, 8.0]              # the gradient's
    scaling.eval()                                   # evaluation reads the history, pushes nothing
    fp8_linear(X, W, None, scaling)
    assert scaling.amax_history[0].tolist() == [0.75, 1.5, 6.0]


def test_margin_divides_the_scale():
    recipe = Fp8Recipe(format="e4m3", recipe="tensorwise", margin=2)
    sc = Fp8Scaling(recipe).tensor_scale(X, 0, E4M3, None, record=False)
    assert sc == _f32(448.0 / 3.0 / 4.0)


# ---- forward and backward against a quantize-dequantize reference -----------------------------
def _qdq(t, dtype, dim=None, pow2=False):
    """Hand-written fp64 reference of a cast: t * s -> fp8 -> / s, s = F / amax."""
    top = torch.finfo(dtype).max
    a = t.double().abs()
    a = a.amax() if dim is None else a.amax(dim=dim, keepdim=True)
    s = (top / a).float().double()
    if pow2:
        s = 2.0 ** torch.floor(torch.log2(s))
    q = (t.double() * s).clamp(-top, top).float().to(dtype)
    return q.double() / s


def _reference(recipe, x, w, g):
    gd = E5M2 if recipe.format == "hybrid" else E4M3
    if recipe.recipe == "rowwise":
        y = _qdq(x, E4M3, 1, True) @ _qdq(w, E4M3, 1, True).t()
        dx = _qdq(g, gd, 1, True) @ _qdq(w, E4M3, 0, True)
        dw = _qdq(g, gd, 0, True).t() @ _qdq(x, E4M3, 0, True)
    else:   # tensorwise, and delayed at its first call (the history is empty)
        xq, wq, gq = _qdq(x, E4M3), _qdq(w, E4M3), _qdq(g, gd)
        y, dx, dw = xq @ wq.t(), gq @ wq, gq.t() @ xq
    return y, dx, dw


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("kind", ["tensorwise", "delayed", "rowwise"])
def test_fp8_linear_equals_the_quantize_dequantize_reference(fmt, kind):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 48, generator=gen).to(torch.bfloat16)
    w = (torch.randn(64, 48, generator=gen) * 0.05).to(torch.bfloat16)
    g = (torch.randn(32, 64, generator=gen) * 1e-3).to(torch.bfloat16)
    recipe = Fp8Recipe(format=fmt, recipe=kind)
    y, dx, dw, _ = _run(recipe, x, w, g)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    for got, ref, what in zip((y, dx, dw), _reference(recipe, x, w, g), ("Y", "dX", "dW")):
        # one bf16 rounding of the fp32 GEMM result (2^-9 relative) apart
        torch.testing.assert_close(got.double(), ref, rtol=2 ** -8, atol=ref.abs().max() * 2 ** -10,
                                   msg=lambda m, what=what: f"{kind} {fmt} {what}: {m}")
        exact = {"Y": x.double() @ w.double().t(), "dX": g.double() @ w.double(),
                 "dW": g.double().t() @ x.double()}[what]
        assert (got.double() - exact).abs().max() > 1e-3 * exact.abs().max()   # fp8, not bf16


def test_bias_and_leading_dims():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 16, generator=gen, requires_grad=True)
    w = torch.randn(32, 16, generator=gen, requires_grad=True)
    b = torch.randn(32, generator=gen, requires_grad=True)
    y = fp8_linear(x, w, b, Fp8Scaling(Fp8Recipe(recipe="tensorwise")))
    assert y.shape == (4, 2, 32) and y.dtype == torch.float32
    y.sum().backward()
    torch.testing.assert_close(b.grad, torch.full((32,), 8.0))
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


# ---- TP 2 against one device ------------------------------------------------------------------
S, B, H, F = 8, 2, 16, 32


def _tp_checks(rank: int, world: int) -> list[str]:
    state = ParallelState.initialize(Topology(world, world, gpus_per_node=world))
    group, done = state.tp, []
    for kind in ("tensorwise", "delayed", "rowwise"):
        for sp in (False, True):
            recipe = Fp8Recipe(format="hybrid", recipe=kind)
            gen = torch.Generator().manual_seed(3)
            w1 = torch.randn(F, H, generator=gen) * 0.1
            w2 = torch.randn(H, F, generator=gen) * 0.1
            x = torch.randn(S, B, H, generator=gen)
            g = torch.randn(S, B, H, generator=gen)
            # single-device reference: the same fp8 linears on the full tensors
            rx = x.clone().requires_grad_()
            rw1, rw2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
            s1, s2 = Fp8Scaling(recipe), Fp8Scaling(recipe)
            ry = fp8_linear(fp8_linear(rx, rw1, None, s1), rw2, None, s2)
            ry.backward(g)
            # TP 2: column-parallel then row-parallel, each rank its shard
            col = ColumnParallelLinear(H, F, group, bias=False, sequence_parallel=sp)
            row = RowParallelLinear(F, H, group, bias=False, sequence_parallel=sp)
            col.load_full_(weight=w1)
            row.load_full_(weight=w2)
            col.fp8, row.fp8 = Fp8Scaling(recipe), Fp8Scaling(recipe)
            tx = x.clone().requires_grad_()
            inp = scatter_to_sequence(tx, group) if sp else tx
            y = row(col(inp))                                          # [s(/tp), b, h]
            if sp:
                part = S // world
                ref_y, ref_g = ry[rank * part:(rank + 1) * part], g[rank * part:(rank + 1) * part]
            else:
                ref_y, ref_g = ry, g
            torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
            y.backward(ref_g)
            tol = dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tx.grad, rx.grad, **tol)
            torch.testing.assert_close(col.weight.grad, rw1.grad.chunk(world, 0)[rank], **tol)
            torch.testing.assert_close(row.weight.grad, rw2.grad.chunk(world, 1)[rank], **tol)
            if kind == "delayed":   # the histories hold the single device's amaxes
                assert torch.equal(col.fp8.amax_history, s1.amax_history)
                assert torch.equal(row.fp8.amax_history, s2.amax_history)
            done.append(f"{kind} sp={sp}")
    return done


@pytest.mark.slow   # two spawned ranks: about a minute on the shared CI cores
def test_tp2_column_and_row_parallel_equal_one_device():
    results = run_on_ranks(_tp_checks, 2, timeout=300)
    assert results[0] == results[1] and len(results[0]) == 6
