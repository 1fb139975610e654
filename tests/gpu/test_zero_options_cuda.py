"""The topology-aware ZeRO options (ZeRO++ §3 hpZ, qwZ, qgZ; hybrid sharding) on CUDA.

* one GPU: the block-wise int8 quantizer of qwZ / qgZ (hybrid/zero/quantize.py) on CUDA tensors
  gives the CPU's bytes exactly (the same IEEE fp32 max, divide and round-half-even), fp32 and bf16
  inputs, a short last block, an all-zero block and a non-finite one;
* **NCCL**, 4 GPUs as 2 hosts x 2 (``gpus_per_node=2``, one GPU per rank): stage 3 plain, hpZ,
  hybrid sharding, qwZ, qgZ and hpZ + qwZ + qgZ for 3 steps, fp32 with TF32 off. Plain stage 3
  against the same run on 4 CPU gloo ranks (losses rtol 1e-5, parameters the CUDA suite's
  tolerances); hpZ and hybrid sharding equal plain (exact algorithms, rtol 1e-5); the quantized ones
  within tests/zero/test_quantized.py's loss bound of plain and not equal to it; every option sends
  fewer bytes across hosts than plain by the ledger. Skipped below 4 GPUs, with that reason.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.quantize import BLOCK, pack, unpack
from tests.gpu.cuda_helpers import PARAM_ATOL, PARAM_RTOL, ieee_fp32, nccl_reason
from tests.zero.test_quantized import LOSS_GAP
from tests.zero.test_stage3 import build, data, train_step

WORLD, PER_HOST, STEPS = 4, 2, 3
VARIANTS = {"plain": {}, "hpz": {"hpz": True}, "hsdp": {"hybrid_shard": True},
            "qwz": {"quantized_weights": True}, "qgz": {"quantized_gradients": True},
            "zeropp": {"hpz": True, "quantized_weights": True, "quantized_gradients": True}}
EXACT, QUANTIZED = ("hpz", "hsdp"), ("qwz", "qgz", "zeropp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_on_cuda_gives_the_cpu_bytes(dtype):
    g = torch.Generator().manual_seed(3)
    numel = 5 * BLOCK + 37                                      # a short last block
    x = (torch.randn(4, numel, generator=g) * torch.rand(4, numel, generator=g).pow(3) * 20).to(dtype)
    x[1, :BLOCK] = 0.0                                          # an all-zero block
    x[2, BLOCK + 3] = float("inf")                              # a non-finite block
    on_cpu, on_gpu = pack(x), pack(x.cuda())
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.int8
    assert torch.equal(on_gpu.cpu(), on_cpu)
    back_cpu, back_gpu = unpack(on_cpu, numel), unpack(on_gpu, numel)
    torch.testing.assert_close(back_gpu.cpu(), back_cpu, rtol=0, atol=0, equal_nan=True)
    assert back_gpu[2, BLOCK:2 * BLOCK].isnan().all() and back_gpu[1, :BLOCK].eq(0).all()


def _options(rank: int, world: int, backend: str) -> dict:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    state = ParallelState.initialize(Topology(world, 1, gpus_per_node=PER_HOST), backend=backend,
                                     device=device, dp_transport="gloo" if backend == "gloo" else "auto")
    tokens, labels = data(steps=STEPS)
    out = {}
    with ieee_fp32():
        for name, options in VARIANTS.items():
            model, opt = build(state, ZeroConfig(stage=3, **options))
            losses = []
            for i in range(STEPS):
                mark = state.ledger.position
                losses.append(train_step(model, opt, state, tokens[i].to(device),
                                         labels[i].to(device), 1)[0])
                opt.zero_grad()
                cross = sum(r.cross_host_bytes for r in state.ledger.since(mark)
                            if r.group.startswith("dp"))
            params = {k: v.float().cpu().numpy() for k, v in opt.gathered_state_dict().items()}
            out[name] = {"losses": losses, "params": params, "cross": cross}
    return out


def test_options_on_nccl_as_two_hosts_of_two():
    reason = nccl_reason(WORLD)
    if reason:
        pytest.skip(reason)
    nccl = run_on_ranks(_options, WORLD, args=("nccl",), backend="nccl", timeout=600)
    gloo = run_on_ranks(_options, WORLD, args=("gloo",), timeout=600)
    for rank, (gpu, cpu) in enumerate(zip(nccl, gloo)):
        plain = gpu["plain"]
        torch.testing.assert_close(torch.tensor(plain["losses"]), torch.tensor(cpu["plain"]["losses"]),
                                   rtol=1e-5, atol=0, msg=lambda m: f"rank {rank} NCCL vs gloo: {m}")
        for k, v in plain["params"].items():
            torch.testing.assert_close(torch.from_numpy(v), torch.from_numpy(cpu["plain"]["params"][k]),
                                       rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m: f"{k}: {m}")
        for name in EXACT:
            assert gpu[name]["losses"] == pytest.approx(plain["losses"], rel=1e-5), (rank, name)
            for k, v in gpu[name]["params"].items():
                torch.testing.assert_close(torch.from_numpy(v), torch.from_numpy(plain["params"][k]),
                                           rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
        for name in QUANTIZED:
            gaps = [abs(a - b) for a, b in zip(gpu[name]["losses"], plain["losses"])]
            assert 0 < max(gaps) <= LOSS_GAP, (rank, name, gaps)
        for name in VARIANTS:
            if name != "plain":
                assert 0 < gpu[name]["cross"] < plain["cross"], (rank, name)
