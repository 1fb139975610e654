"""Gradients streamed to the offload backends during backward (ZeRO-Offload §4.2, ZeRO-Infinity §5),
without an engine: ``accept_grad(chunk, grad)`` stages a chunk's final reduced gradient (host fp32
memory, or the NVMe gradient file), ``update(None, ..., grad_scale=)`` then uses it. Checked against
hybrid.zero.adamw.adamw_step on the unscaled gradients (bitwise, ``exact`` kernel) and against the
non-staged path of the same backend (bitwise, both kernels), with 16-bit gradients, partial staging,
the documented gradient-file layout, constant resident buffers and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.offload import CPUAdamW, HostOptimizerState, NVMeOptimizerState
from hybrid.zero.adamw import adamw_step

CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SIZES, DECAY = [100, 64, 250], [[(0, 40)], [], [(10, 200)]]
SCALE = 3.0   # what the engines divide by: DP size x loss scale / clip coefficient


def _backend(kind, tmp_path, kernel="exact", block=37, name="a"):
    adam = CPUAdamW(CFG, kernel=kernel, block_elems=block)
    if kind == "host":
        backend = HostOptimizerState(SIZES, DECAY, adam, device=torch.device("cpu"),
                                     param_dtype=torch.float32)
    else:
        backend = NVMeOptimizerState(SIZES, DECAY, adam, device=torch.device("cpu"),
                                     param_dtype=torch.float32, directory=str(tmp_path / name),
                                     rank=0)
    g = torch.Generator().manual_seed(7)
    for c, size in enumerate(SIZES):
        backend.write_master(c, 0, torch.randn(size, generator=g))
    return backend


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * 4).to(dtype) for s in SIZES]


def _state(backend):
    return {k: torch.cat([t.clone() for t in backend.fragment_views(k)])
            for k in ("master", "exp_avg", "exp_avg_sq")}


def _train(backend, *, staged, steps=3, dtype=torch.float32, clobber=False):
    """``staged``: chunks to accept_grad during 'backward'; the others go to update as grads."""
    params = [torch.zeros(s) for s in SIZES]
    for step in range(steps):
        grads = _grads(step, dtype)
        for c in staged:
            backend.accept_grad(c, grads[c])
            if clobber:   # the engine reuses its buffer: the staged copy must not change
                grads[c].fill_(1e9)
        passed = None if len(staged) == len(SIZES) else [g.float() for g in grads]
        backend.update(passed, params, lr=CFG.lr, grad_scale=SCALE)
    return params, _state(backend)


def _reference(steps=3, dtype=torch.float32):
    """adamw_step (the engines' foreach AdamW) on gradients x (1 / SCALE)."""
    g = torch.Generator().manual_seed(7)
    p = [torch.randn(s, generator=g) for s in SIZES]
    m, v = [torch.zeros(s) for s in SIZES], [torch.zeros(s) for s in SIZES]
    for step in range(steps):
        grads = [x.float() for x in _grads(step, dtype)]
        torch._foreach_mul_(grads, 1.0 / SCALE)
        decay = [p[c][o:o + n] for c, ranges in enumerate(DECAY) for o, n in ranges]
        adamw_step(p, grads, m, v, decay, step=step + 1, config=CFG)
    return torch.cat(p), torch.cat(m), torch.cat(v)


@pytest.mark.parametrize("kind", ["host", "nvme"])
def test_staged_gradients_equal_reference_adamw(kind, tmp_path):
    backend = _backend(kind, tmp_path)
    params, state = _train(backend, staged=[0, 1, 2], clobber=True)
    p, m, v = _reference()
    assert torch.equal(state["master"], p) and torch.equal(torch.cat(params), p)
    assert torch.equal(state["exp_avg"], m) and torch.equal(state["exp_avg_sq"], v)
    backend.close()


@pytest.mark.parametrize("kind", ["host", "nvme"])
@pytest.mark.parametrize("kernel", ["exact", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_equals_passed_gradients(kind, kernel, dtype, tmp_path):
    """Every chunk staged, some staged, none staged: bitwise the same numbers."""
    runs = []
    for i, staged in enumerate(([0, 1, 2], [1], [])):
        backend = _backend(kind, tmp_path, kernel, name=f"r{i}")
        runs.append(_train(backend, staged=staged, dtype=dtype))
        backend.close()
    for params, state in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, runs[0][0]))
        assert all(torch.equal(state[k], runs[0][1][k]) for k in state)
    if dtype == torch.float32 and kernel == "exact":
        assert torch.equal(runs[0][1]["master"], _reference()[0])


def test_fused_grad_scale_is_the_kernel_division():
    """``fused``: the division is torch's fused kernel's own grad_scale (as the non-offloaded
    engine's fused path runs it), bitwise; within rounding of dividing beforehand."""
    n = 300
    g0 = torch.randn(n, generator=torch.Generator().manual_seed(3))
    mine, ref = torch.ones(n), torch.ones(n)
    m, v, m2, v2 = (torch.zeros(n) for _ in range(4))
    CPUAdamW(CFG, block_elems=64).step_(mine, g0.clone(), m, v, [(0, n)], step=1, lr=CFG.lr,
                                        grad_scale=SCALE)
    torch._fused_adamw_([ref], [g0.clone()], [m2], [v2], [], [torch.tensor(1.0)], lr=CFG.lr,
                        beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False,
                        maximize=False, grad_scale=torch.tensor(SCALE))
    assert torch.equal(mine, ref) and torch.equal(v, v2)
    with pytest.raises(ValueError, match="grad_scale"):
        CPUAdamW(CFG).step_(mine, g0, m, v, [], step=2, lr=CFG.lr, grad_scale=0.0)


def test_nvme_gradient_file_layout_and_constant_buffers(tmp_path):
    """Chunks land at their documented offsets of offload_grads_rank*.bin as fp32; the resident
    buffers are the same before and after streaming (4 x 4 B per block element, two buffers)."""
    backend = _backend("nvme", tmp_path, block=37)
    before = sum(t.nbytes for t in backend.resident()["buffers"])
    assert before == 2 * 4 * 4 * 37
    grads = _grads(0, torch.bfloat16)
    for c in (2, 0, 1):                        # any order: each chunk has its own place
        backend.accept_grad(c, grads[c])
    backend.drop_staged_grads()                # lands the writes; nothing is used
    raw = np.fromfile(backend.grad_path, dtype=np.float32)
    assert backend.grad_path.endswith("offload_grads_rank00000.bin")
    assert torch.equal(torch.from_numpy(raw), torch.cat([g.float() for g in grads]))
    assert sum(t.nbytes for t in backend.resident()["buffers"]) == before
    backend.close()


@pytest.mark.parametrize("kind", ["host", "nvme"])
def test_staging_errors_and_skipped_step(kind, tmp_path):
    backend = _backend(kind, tmp_path)
    params = [torch.zeros(s) for s in SIZES]
    with pytest.raises(ValueError, match="chunk has 100"):
        backend.accept_grad(0, torch.zeros(99))
    with pytest.raises(ValueError, match="no staged gradient"):
        backend.update(None, params, lr=CFG.lr)
    for c, grad in enumerate(_grads(0)):
        backend.accept_grad(c, grad)
    backend.drop_staged_grads()                # a skipped step: they must not be used later
    with pytest.raises(ValueError, match="no staged gradient"):
        backend.update(None, params, lr=CFG.lr)
    assert backend.step == 0                   # refused before anything changed
    backend.close()
