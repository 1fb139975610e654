"""The GPT on one GPU: fp32 parity with the CPU oracle (TF32 off), bf16 / fp16 training with loss
scaling, and every activation-recompute mode bit-equal to no recompute on CUDA (docs/design.md §4).

The recompute check is the CPU one (tests/recompute/test_gpt.py) on the GPU's kernels: dropout 0.1
draws from the CUDA generator (RNGTracker on cuda), selective recompute reruns SDPA, Pa+cpu's
checkpoints go to pinned host memory on a side stream and come back ahead of the recompute.
"""

from __future__ import annotations

import pytest
import torch

from hybrid.parallel_state import ParallelState
from hybrid.recompute import RecomputePlan
from hybrid.tensor_parallel import RNGTracker
from hybrid.zero.config import LossScaleConfig, ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt import sharding
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from models.gpt.reference import ReferenceGPT
from tests.gpu.cuda_helpers import bitwise_reproducible, ieee_fp32, train_on_device
from tests.recompute.test_gpt import MODES, _plan
from tests.zero.test_stages import GPTTask, reference_run

PARITY_CONFIG = GPTConfig(2, 64, 4, vocab_size=101, seq_length=64, hidden_dropout=0.0,
                          attention_dropout=0.0, make_vocab_size_divisible_by=4)
DROPOUT_CONFIG = GPTConfig(3, 96, 8, vocab_size=128, seq_length=32, hidden_dropout=0.1,
                           attention_dropout=0.1)
# bf16 keeps 8 significant bits, fp16 11 (tests/zero/test_precision.py derives these bounds on CPU)
LOSS_RTOL = {"bf16": 2e-2, "fp16": 2e-2}
TRAJECTORY_BOUND = {"bf16": 0.10, "fp16": 0.02}


def tokens_and_labels(config: GPTConfig, batch: int, seed: int = 23):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, config.seq_length)
    return (torch.randint(0, config.vocab_size, shape, generator=gen),
            torch.randint(0, config.vocab_size, shape, generator=gen))


def test_fp32_forward_backward_matches_the_cpu_oracle():
    """Loss and every gradient of GPTModel on CUDA (SDPA, vocab-parallel cross-entropy) against
    ReferenceGPT on CPU, same canonical weights: rtol 1e-5 on the loss, 1e-4 on gradients."""
    tokens, labels = tokens_and_labels(PARITY_CONFIG, 4)
    ref = ReferenceGPT(PARITY_CONFIG)
    ref.init_weights(3)
    ref_loss = ref(tokens, labels).mean()
    ref_loss.backward()
    with ieee_fp32():
        model = GPTModel(PARITY_CONFIG, ParallelState.single_process("cuda"))
        model.init_weights(3)
        loss = model(tokens.cuda(), labels.cuda()).mean()
        loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        expected = sharding.shard_tensor(PARITY_CONFIG, name, dict(ref.named_parameters())[name].grad,
                                         0, 1)
        torch.testing.assert_close(p.grad.cpu(), expected, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_tracks_the_fp32_oracle(precision, figures):
    """ZeRO stage 1 on one GPU in bf16 / fp16 (fp32 master, loss scale 2^8 for fp16), default SDPA
    kernels (flash where the GPU has it): losses within 2% of the fp32 CPU oracle's, no skipped
    step, and the parameter trajectory within the CPU suite's bounds."""
    task = GPTTask()
    data = task.data()
    ref = reference_run(task, data)
    init = {n: p.detach().clone() for n, p in task.reference().named_parameters()}
    state = ParallelState.single_process("cuda")
    model = task.model(state)
    cfg = ZeroConfig(stage=1, precision=precision, loss_scale=LossScaleConfig(initial_scale=2.0 ** 8))
    opt = build_zero_optimizer(model, state, cfg, task.adamw)
    losses, results = train_on_device(task, state, opt, model, data)
    assert not any(r.skipped for r in results)
    assert all(p.dtype == cfg.param_dtype and p.device == state.device for p in model.parameters())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=LOSS_RTOL[precision],
                               atol=0)
    err = moved = 0.0
    for name, p in model.named_parameters():
        target = task.shard(name, ref[2][name], p, state)
        start = task.shard(name, init[name], p, state)
        err += (p.detach().float().cpu() - target).square().sum().item()
        moved += (target - start).square().sum().item()
    trajectory = (err / moved) ** 0.5
    figures(f"{precision} trajectory error vs fp32 oracle", value=trajectory,
            bound=TRAJECTORY_BOUND[precision])
    assert trajectory < TRAJECTORY_BOUND[precision]


def test_fp16_loss_scale_backs_off_from_overflow_and_skips_cleanly():
    """Initial scale 2^24 overflows fp16 gradients (d loss / d logits ~ 2^24 / 64 tokens > 65504):
    those steps are skipped with parameters bit-equal, the scale halves each time (hysteresis 1),
    and training resumes with finite losses once it fits."""
    task = GPTTask()
    data = task.data(steps=20)
    state = ParallelState.single_process("cuda")
    model = task.model(state)
    cfg = ZeroConfig(stage=1, precision="fp16",
                     loss_scale=LossScaleConfig(initial_scale=2.0 ** 24, hysteresis=1))
    opt = build_zero_optimizer(model, state, cfg, task.adamw)
    before = [p.detach().clone() for p in model.parameters()]
    losses, results = train_on_device(task, state, opt, model, data[:1])
    assert results[0].skipped and results[0].loss_scale == 2.0 ** 24
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    more_losses, more = train_on_device(task, state, opt, model, data[1:])
    results += more
    skipped = [r for r in results if r.skipped]
    scales = [r.loss_scale for r in skipped]
    assert scales == [2.0 ** 24 / 2 ** i for i in range(len(scales))], scales
    assert not results[-1].skipped and len(skipped) < len(results)
    assert all(torch.isfinite(torch.tensor(x)) for x in more_losses)


def _recompute_step(name: str, config: GPTConfig, micro_batch: int):
    state = ParallelState.single_process("cuda")
    rng = RNGTracker(17, 0, state.device)
    rng.seed_all()
    model = GPTModel(config, state, rng=rng, recompute=_plan(name, config.num_layers))
    model.init_weights(5)
    tokens, labels = tokens_and_labels(config, micro_batch)
    loss = model(tokens.cuda(), labels.cuda()).mean()
    loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, model.recomputer


@pytest.mark.parametrize("name", list(MODES))
def test_recompute_mode_is_bit_equal_to_none(name):
    """selective, full, full k=2, Pa, Pa + MD arena, Pa+cpu: loss and gradients bit for bit."""
    with bitwise_reproducible():
        ref_loss, ref_grads, _ = _recompute_step("none", DROPOUT_CONFIG, 3)
        loss, grads, recomputer = _recompute_step(name, DROPOUT_CONFIG, 3)
    assert torch.equal(loss, ref_loss), (name, loss.item(), ref_loss.item())
    for key, g in ref_grads.items():
        assert torch.equal(grads[key], g), (name, key, (grads[key] - g).abs().max().item())
    if name == "full-pa-cpu":   # the checkpoints really went to pinned host memory
        store = recomputer.stores["full-pa-cpu"]
        assert store.counters.offloaded_bytes > 0 and store.side_stream is not None
        host = recomputer.host_arena
        assert host.tier == "host" and host.pin_memory and host.stats().num_chunks > 0
    if name == "full-pa-md":
        assert recomputer.device_arena.device == torch.device("cuda", torch.cuda.current_device())
        assert recomputer.device_arena.live == 0   # every checkpoint released after backward
