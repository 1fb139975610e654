"""Optimizer offload (hybrid.offload) changes where the optimizer state lives, not the numbers.

For ZeRO stages 0-3 at DP 2 (tiny GPTModel, 5 steps, fp32) a run with the fp32 master and Adam
moments offloaded to host memory (``cpu``) or to files (``nvme``) is compared with the same run
without offload: with the ``exact`` CPU Adam kernel losses, parameters and every optimizer-state
fragment are bitwise equal (also with stage 3's parameter partitions on NVMe, ``params="nvme"``);
with the default ``fused`` kernel (torch's single-pass AdamW, within about an ulp per step) they
agree to rtol 1e-6. Also bf16 mixed precision (bitwise, exact kernel), and a checkpoint round
trip: fragments saved from a CPU-offloaded stage 1 run load into an NVMe-offloaded stage 2 run that
continues exactly like the uninterrupted run.
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid.offload import OffloadConfig
from hybrid.parallel_state import ParallelState
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from hybrid.zero.results import Fragment
from tests.zero.test_stages import GPTTask, train


def _params(opt, model) -> dict[str, torch.Tensor]:
    if opt.config.stage == 3:
        return opt.gathered_state_dict()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fragments(opt) -> dict[tuple, torch.Tensor]:
    return {(f.param_name, f.kind, f.offset): f.tensor.clone() for f in opt.owned_fragments()}


def _run(task, state, data, stage, precision="fp32", offload=None, kernel="foreach"):
    """``kernel``: the in-device engine's AdamW; ``foreach`` is the op order of the ``exact``
    offload kernel, so those runs can be compared bitwise."""
    model = task.model(state)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=stage, precision=precision,
                                                        bucket_size=700),
                               dataclasses.replace(task.adamw, kernel=kernel), offload=offload)
    losses, _ = train(task, state, opt, model, data, 1)
    out = losses, _params(opt, model), _fragments(opt), opt.memory_report()
    if offload is not None:
        opt.optimizer_state.close()
    return out


def _compare(base, run, exact: bool, what: str) -> None:
    check = ((lambda a, b, m: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=m)) if exact
             else (lambda a, b, m: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=m)))
    check(torch.tensor(run[0]), torch.tensor(base[0]), f"{what}: losses")
    for name, value in base[1].items():
        check(run[1][name].float(), value.float(), f"{what}: param {name}")
    assert run[2].keys() == base[2].keys(), f"{what}: fragments differ in layout"
    for key, value in base[2].items():
        if exact or key[1] != "master":
            check(run[2][key], value, f"{what}: fragment {key}")


def _parity(rank, world_size, tmpdir):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    task = GPTTask()
    data = task.data()
    checked = []
    for stage in (0, 1, 2, 3):
        base = _run(task, state, data, stage)
        for mode, kernel in (("cpu", "exact"), ("nvme", "exact"), ("nvme", "fused")):
            offload = OffloadConfig(mode, f"{tmpdir}/s{stage}", block_elems=96, kernel=kernel)
            run = _run(task, state, data, stage, offload=offload)
            if kernel == "fused":   # also against the engine's own fused kernel
                _compare(_run(task, state, data, stage, kernel="fused"), run, False,
                         f"stage {stage} {mode} fused vs in-device fused")
            _compare(base, run, kernel == "exact", f"stage {stage} {mode} {kernel}")
            if mode == "nvme":   # nothing of the optimizer state is resident but the buffers
                assert run[3].measured["master32"] == run[3].measured["adam_moments"] == 0
            else:
                assert run[3].measured["adam_moments"] == base[3].measured["adam_moments"]
            checked.append((stage, mode, kernel))
    # ZeRO-Infinity parameter offload: stage 3's 16-bit partitions in a file as well
    offload = OffloadConfig("nvme", f"{tmpdir}/p3", block_elems=96, kernel="exact", params="nvme")
    run = _run(task, state, data, 3, offload=offload)
    _compare(_run(task, state, data, 3), run, True, "stage 3 nvme params")
    checked.append((3, "nvme-params", "exact"))
    for stage, mode in ((1, "cpu"), (3, "nvme")):
        base = _run(task, state, data, stage, "bf16")
        offload = OffloadConfig(mode, f"{tmpdir}/b{stage}", block_elems=64, kernel="exact")
        _compare(base, _run(task, state, data, stage, "bf16", offload), True,
                 f"bf16 stage {stage} {mode}")
        checked.append((stage, mode, "bf16"))
    return checked


def test_offload_matches_no_offload_every_stage_dp2(tmp_path):
    checked = run_on_ranks(_parity, 2, args=(str(tmp_path),), timeout=300)
    assert len(checked[0]) == 4 * 3 + 1 + 2


def _resume(rank, world_size, tmpdir):
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    task = GPTTask()
    data = task.data()
    base = _run(task, state, data, 2)
    model = task.model(state)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=1, bucket_size=500), task.adamw,
                               offload=OffloadConfig("cpu", kernel="exact"))
    first, _ = train(task, state, opt, model, data[:3], 1)
    saved = [Fragment(f.param_name, f.kind, f.offset, f.tensor.clone())
             for f in opt.owned_fragments()]
    gathered = [None] * world_size   # every rank loads every rank's fragments (any-layout load)
    torch.distributed.all_gather_object(gathered, saved)
    fresh = task.model(state)
    opt2 = build_zero_optimizer(fresh, state, ZeroConfig(stage=2, bucket_size=900), task.adamw,
                                offload=OffloadConfig("nvme", f"{tmpdir}/r", block_elems=80,
                                                      kernel="exact"))
    opt2.load_fragments([f for frags in gathered for f in frags])
    opt2.step_count = opt.step_count
    rest, _ = train(task, state, opt2, fresh, data[3:], 1)
    torch.testing.assert_close(torch.tensor(first + rest), torch.tensor(base[0]), rtol=0, atol=0)
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p.detach(), base[1][name], rtol=0, atol=0)
    opt2.optimizer_state.close()
    return True


def test_offloaded_fragments_resume_across_modes_and_stages(tmp_path):
    assert all(run_on_ranks(_resume, 2, args=(str(tmp_path),)))
