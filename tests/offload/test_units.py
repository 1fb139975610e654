"""Pure checks of hybrid.offload without process groups: the CPU Adam against hybrid.zero.adamw and
torch.optim.AdamW, the NVMe backend against the host backend (same numbers, documented file layout,
memory-mapped checkpoint views), size parsing and the budget planner's decisions and errors,
including what a ZeRO-3 engine tells the planner it keeps resident with its parameters on NVMe."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.offload import (CPUAdamW, HostOptimizerState, NVMeOptimizerState, OffloadConfig,
                            parse_bytes, plan_block_elems)
from hybrid.offload.cpu_adam import Span, split_spans
from hybrid.zero.adamw import adamw_step

CFG = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
DECAY = [(10, 100), (300, 50), (900, 100)]


def _grads(n, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(steps)]


def test_split_spans_covers_block_in_order():
    spans = split_spans(50, 400, DECAY)
    assert spans == [Span(0, 60, True), Span(60, 190, False), Span(250, 50, True),
                     Span(300, 50, False)]
    assert sum(s.numel for s in spans) == 350


@pytest.mark.parametrize("kernel", ["exact", "fused"])
def test_cpu_adam_matches_reference_adamw(kernel):
    """exact: bitwise equal to hybrid.zero.adamw.adamw_step; fused: within about an ulp per step. Blocks (128) cut through decayed ranges; bf16 write-back equals the rounded master."""
    n = 1000
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    ref, mine = p0.clone(), p0.clone()
    m_ref, v_ref, m, v = (torch.zeros(n) for _ in range(4))
    out = torch.zeros(n, dtype=torch.bfloat16)
    adam = CPUAdamW(CFG, kernel=kernel, block_elems=128)
    for step, g in enumerate(_grads(n, 4), start=1):
        adamw_step([ref], [g], [m_ref], [v_ref], [ref[o:o + c] for o, c in DECAY], step=step,
                   config=CFG)
        adam.step_(mine, g, m, v, DECAY, step=step, lr=CFG.lr, out=out)
    if kernel == "exact":
        assert torch.equal(mine, ref) and torch.equal(m, m_ref) and torch.equal(v, v_ref)
    else:
        for a, b in ((mine, ref), (m, m_ref), (v, v_ref)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert torch.equal(out, mine.to(torch.bfloat16))


def test_cpu_adam_fused_matches_torch_adamw_with_decay_groups():
    n = 500
    p = torch.nn.Parameter(torch.randn(n))
    flat = p.detach().clone()
    opt = torch.optim.AdamW([p], lr=CFG.lr, betas=CFG.betas, eps=CFG.eps,
                            weight_decay=CFG.weight_decay)
    m, v = torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(_grads(n, 3), start=1):
        p.grad = g.clone()
        opt.step()
        CPUAdamW(CFG, block_elems=77).step_(flat, g, m, v, [(0, n)], step=step, lr=CFG.lr)
    torch.testing.assert_close(flat, p.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, opt.state[p]["exp_avg_sq"], rtol=1e-6, atol=0)


def test_cpu_adam_rejects_bad_input():
    with pytest.raises(ValueError, match="kernel"):
        CPUAdamW(CFG, kernel="avx512")
    with pytest.raises(ValueError, match="equal lengths"):
        CPUAdamW(CFG).step_(torch.zeros(4), torch.zeros(3), torch.zeros(4), torch.zeros(4), [],
                            step=1, lr=1e-3)


def _backend_run(backend, sizes, steps=3):
    """Drive a backend like an engine: masters from known values, updates into fp32 'params'."""
    g = torch.Generator().manual_seed(7)
    for c, size in enumerate(sizes):
        backend.write_master(c, 0, torch.randn(size, generator=g))
    params = [torch.zeros(s) for s in sizes]
    for _ in range(steps):
        backend.update([torch.randn(s, generator=g) for s in sizes], params, lr=CFG.lr)
    return params


def test_nvme_backend_equals_host_backend_and_file_layout(tmp_path):
    """Odd block size (37) so blocks straddle chunk ends and the double buffers wrap many times."""
    sizes, decay = [100, 64, 250], [[(0, 40)], [], [(10, 200)]]
    host = HostOptimizerState(sizes, decay, CPUAdamW(CFG, kernel="exact", block_elems=37),
                              device=torch.device("cpu"), param_dtype=torch.float32)
    nvme = NVMeOptimizerState(sizes, decay, CPUAdamW(CFG, kernel="exact", block_elems=37),
                              device=torch.device("cpu"), param_dtype=torch.float32,
                              directory=str(tmp_path), rank=3)
    p_host, p_nvme = _backend_run(host, sizes), _backend_run(nvme, sizes)
    for a, b in zip(p_host, p_nvme):
        assert torch.equal(a, b)
    n = sum(sizes)
    assert os.path.getsize(nvme.path) == 12 * n and nvme.path.endswith("offload_rank00003.bin")
    raw = np.fromfile(nvme.path, dtype=np.float32).reshape(3, n)   # [master | exp_avg | exp_avg_sq]
    for k, kind in enumerate(("master", "exp_avg", "exp_avg_sq")):
        assert torch.equal(torch.from_numpy(raw[k].copy()), host.flat[kind])
        for a, b in zip(nvme.fragment_views(kind), host.fragment_views(kind)):
            assert torch.equal(a, b)
    assert nvme.resident()["master32"] == [] and nvme.tensors() == []
    nvme.fragment_views("master")[1][5] = 42.0          # a checkpoint load writes through the map
    out = [torch.zeros(s) for s in sizes]
    nvme.publish(out)
    assert out[1][5] == 42.0 and torch.equal(out[2], host.flat["master"][164:])
    nvme.close()


def test_nvme_file_is_owned_by_one_optimizer(tmp_path):
    def make():
        return NVMeOptimizerState([8], [[]], CPUAdamW(CFG), device=torch.device("cpu"),
                                  param_dtype=torch.float32, directory=str(tmp_path), rank=0)

    first = make()
    first.write_master(0, 0, torch.arange(8.0))
    with pytest.raises(RuntimeError, match="its own --offload-nvme-path"):
        make()
    assert torch.equal(first.fragment_views("master")[0], torch.arange(8.0))   # not clobbered
    first.close()
    make().close()   # free again once closed


def test_cli_flags_build_the_config(tmp_path):
    from pretrain.arguments import parse_args

    def offload_config(*flags):   # the trainer's own flags and config section
        return parse_args(["--zero-stage", "3", *flags])[0].parallel.offload_config()

    cfg = offload_config("--offload-optimizer", "nvme", "--offload-nvme-path", str(tmp_path),
                         "--host-memory-budget", "4GiB", "--offload-params", "nvme")
    assert (cfg.mode, cfg.host_memory_budget, cfg.enabled, cfg.params) == ("nvme", 4 * 2**30, True,
                                                                           "nvme")
    assert offload_config() is None
    with pytest.raises(ValueError, match="--offload-optimizer nvme"):
        offload_config("--offload-optimizer", "cpu", "--offload-params", "nvme")


def test_parse_bytes_and_config_errors():
    assert parse_bytes("4GiB") == 4 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match="4GiB"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="--offload-nvme-path"):
        OffloadConfig("nvme")
    with pytest.raises(ValueError, match="none"):
        OffloadConfig("gpu")


def test_budget_planner_sizes_buffers_and_refuses_impossible_budgets(tmp_path):
    cfg = OffloadConfig("nvme", str(tmp_path), "1GiB")
    block = plan_block_elems(cfg, owned_numel=10**8, resident_bytes=600 * 2**20)
    # two buffers of master + two moments + gradient (32 B per element) take half of what is left
    assert 32 * block <= (2**30 - 600 * 2**20 - 400 * 2**20) // 2 < 32 * (block + 1)
    assert plan_block_elems(cfg, owned_numel=10**8, resident_bytes=0) == 1 << 20   # the cap
    # never more than a quarter of the partition (more buys no overlap), never below the minimum
    assert plan_block_elems(cfg, owned_numel=10**6, resident_bytes=0) == 250_000
    assert plan_block_elems(OffloadConfig("nvme", str(tmp_path)), 4000, 0) == 1 << 14
    with pytest.raises(ValueError, match="raise the budget"):
        plan_block_elems(cfg, owned_numel=10**8, resident_bytes=2**30)
    with pytest.raises(ValueError, match="nvme"):   # 12 B x 1e8 of host state cannot fit 1 GiB
        plan_block_elems(OffloadConfig("cpu", host_memory_budget="1GiB"), 10**8, 0)
    assert plan_block_elems(OffloadConfig("cpu", host_memory_budget="4GiB"), 10**8, 0) > 0


def test_stage3_planner_counts_the_parameter_store_instead_of_the_partitions(tmp_path, monkeypatch):
    """With ``params="nvme"`` a ZeRO-3 engine reports as resident the store's buffers in place of
    its 16-bit partitions (everything else equal), and a budget fixes glibc's mmap threshold."""
    from hybrid.offload import budget, param_store
    from hybrid.parallel_state import ParallelState
    from hybrid.zero import ZeroConfig, build_zero_optimizer
    from models.gpt.config import GPTConfig
    from models.gpt.model import GPTModel
    seen, plan = [], budget.plan_block_elems
    monkeypatch.setattr(budget, "plan_block_elems",
                        lambda cfg, numel, resident: seen.append(resident) or plan(cfg, numel, resident))
    config, state = GPTConfig(6, 32, 4, vocab_size=64, seq_length=8), ParallelState.single_process()
    for params in ("none", "nvme"):
        opt = build_zero_optimizer(GPTModel(config, state, device="meta"), state, ZeroConfig(stage=3),
                                   CFG, offload=OffloadConfig("nvme", str(tmp_path / params), "4GiB",
                                                              params=params), seed=1)
        opt.optimizer_state.close()
    sizes = [u.chunk for u in opt.all_units]
    store = param_store.resident_bytes(sizes, torch.float32)
    assert store == sum(t.nbytes for t in opt.param_store.resident()) < 4 * sum(sizes)
    assert seen[0] - seen[1] == 4 * sum(sizes) - store
    opt.param_store.close()
    if os.confstr("CS_GNU_LIBC_VERSION"):
        assert budget.return_freed_buffers_to_os()


def test_the_three_optimizer_state_backends_agree_through_their_protocol(tmp_path):
    """The device backend (foreach kernel) and the host and NVMe backends (exact kernel, the same
    op order), driven only through OptimizerStateBackend's methods, leave bit-equal 16-bit
    parameters, masters and moments; each implements every method of the protocol, with its
    parameters."""
    import dataclasses
    import inspect
    from hybrid.offload.backend import STATE_KINDS, OptimizerStateBackend
    from hybrid.zero.optimizer_state import DeviceOptimizerState
    from hybrid.zero.pieces import OwnedPiece
    sizes = [700, 300]
    pieces = [OwnedPiece("a", 0, 0, 0, 400, True, True), OwnedPiece("b", 0, 400, 0, 300, False, True),
              OwnedPiece("c", 1, 0, 0, 300, True, False)]
    decay = [[(0, 400)], [(0, 300)]]
    g = torch.Generator().manual_seed(3)
    init = [torch.randn(n, generator=g) for n in sizes]
    steps = [[torch.randn(n, generator=g) for n in sizes] for _ in range(3)]

    def out():
        return [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    device = DeviceOptimizerState(out(), pieces, dataclasses.replace(CFG, kernel="foreach"),
                                  mixed_precision=True, device=torch.device("cpu"))
    host = HostOptimizerState(sizes, decay, CPUAdamW(CFG, kernel="exact", block_elems=128),
                              device=torch.device("cpu"), param_dtype=torch.bfloat16)
    nvme = NVMeOptimizerState(sizes, decay, CPUAdamW(CFG, kernel="exact", block_elems=128),
                              device=torch.device("cpu"), param_dtype=torch.bfloat16,
                              directory=str(tmp_path), rank=0)
    results = []
    for backend in (device, host, nvme):
        params = out()
        for c, values in enumerate(init):
            backend.write_master(c, 0, values)
        for grads in steps:
            backend.update([t.clone() for t in grads], params, lr=CFG.lr, grad_scale=2.0)
        results.append((params, {k: [t.clone() for t in backend.fragment_views(k)]
                                 for k in STATE_KINDS}, backend.step))
        backend.close()
    for params, state, step in results[1:]:
        assert step == results[0][2] == 3
        for got, want in zip(params, results[0][0]):
            assert torch.equal(got, want)
        for kind in STATE_KINDS:
            for got, want in zip(state[kind], results[0][1][kind]):
                assert torch.equal(got, want), kind
    members = [n for n, v in vars(OptimizerStateBackend).items()
               if callable(v) and not n.startswith("_")]
    assert "update" in members and "publish" in members
    for cls in (DeviceOptimizerState, HostOptimizerState, NVMeOptimizerState):
        for name in members:
            stub, impl = getattr(OptimizerStateBackend, name), getattr(cls, name)
            assert impl is not stub, f"{cls.__name__} lacks {name}"
            assert list(inspect.signature(impl).parameters) == \
                list(inspect.signature(stub).parameters), (cls.__name__, name)
