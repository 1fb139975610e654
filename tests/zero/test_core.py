"""ZeRO shared core without process groups: AdamW parity with torch, loss scaling, config checks,
storage-deduplicated memory measurement and the paper's formulas."""

import pytest
import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.parallel_state import ParallelState
from hybrid.zero.adamw import FlatAdamWState, fused_adamw_step
from hybrid.zero.clip import clip_coefficient, global_grad_norm
from hybrid.zero.config import LossScaleConfig, ZeroConfig
from hybrid.zero.loss_scaler import DynamicLossScaler, build_loss_scaler
from hybrid.zero.report import expected_dp_bytes, formula_bytes, measure_storages


def _torch_adamw_reference():
    """A weight (decayed) and a bias (not), their clones under torch.optim.AdamW, and the config."""
    torch.manual_seed(0)
    w, b = torch.randn(5, 3), torch.randn(7)
    cfg = AdamWConfig(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ref = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    opt = torch.optim.AdamW([{"params": [ref[0]]}, {"params": [ref[1]], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return w, b, cfg, ref, opt


def test_flat_adamw_matches_torch_adamw_with_param_groups():
    w, b, cfg, ref, opt = _torch_adamw_reference()
    flat = torch.cat([w.flatten(), b])                      # one flat fp32 partition, split in 2
    chunks = list(torch.split(flat, [10, 12]))              # chunk boundary inside w
    state = FlatAdamWState([10, 12], "cpu")
    for _ in range(4):
        grads = [torch.randn(5, 3), torch.randn(7)]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        g_chunks = list(torch.split(torch.cat([grads[0].flatten(), grads[1]]), [10, 12]))
        state.update(chunks, g_chunks, [chunks[0], chunks[1][:5]], cfg)
    torch.testing.assert_close(flat, torch.cat([ref[0].detach().flatten(), ref[1].detach()]),
                               rtol=1e-6, atol=1e-7)
    assert state.step == 4


def test_dynamic_loss_scaler_hysteresis_growth_and_floor():
    s = DynamicLossScaler(LossScaleConfig(initial_scale=8, growth_interval=3, hysteresis=2,
                                          min_scale=2))
    s.update(True)
    assert s.scale == 8            # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 4            # second halves
    for _ in range(3):
        s.update(False)
    assert s.scale == 8            # grows after growth_interval clean steps, hysteresis refilled
    s.update(True), s.update(True), s.update(True)
    assert s.scale == 2            # 8 -> (hyst) 8 -> 4 -> 2
    assert s.state_dict()["hysteresis_left"] == 0  # spent, never negative
    with pytest.raises(FloatingPointError, match="minimum loss scale 2"):
        s.update(True)
    restored = DynamicLossScaler(s.config)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()
    assert build_loss_scaler(ZeroConfig(precision="bf16")).scale == 1.0


def test_fused_adamw_with_grad_scale_matches_torch_adamw_groups():
    """The engines' default kernel: torch's fused AdamW with the gradient unscaling folded in."""
    w, b, cfg, ref, opt = _torch_adamw_reference()
    state = FlatAdamWState([15, 7], "cpu")
    mine = [w.flatten().clone(), b.clone()]
    for step in range(1, 5):
        grads = [torch.randn(5, 3), torch.randn(7)]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        scaled = [g.flatten() * 8.0 for g in grads]           # e.g. summed over DP 8
        for i, decay in ((0, True), (1, False)):
            fused_adamw_step([mine[i]], [scaled[i]], [state.exp_avgs[i]], [state.exp_avg_sqs[i]],
                             decay=decay, step=step, config=cfg, grad_scale=8.0)
    torch.testing.assert_close(torch.cat(mine), torch.cat([ref[0].detach().flatten(),
                                                           ref[1].detach()]), rtol=1e-6, atol=1e-7)


def test_grad_norm_on_single_process_groups_counts_nonfinite_everywhere():
    state = ParallelState.single_process()
    nan = global_grad_norm([torch.ones(3)], [torch.tensor([1.0, float("nan")])], tp=state.tp,
                           reduce_group=state.world)
    assert nan != nan
    norm = global_grad_norm([torch.full((4,), 1.0)], [torch.full((5,), 2.0)], tp=state.tp,
                            reduce_group=state.world)
    assert norm == pytest.approx(24 ** 0.5)
    assert clip_coefficient(norm, 1.0) == pytest.approx(1 / (24 ** 0.5 + 1e-6))
    assert clip_coefficient(norm, 100.0) == 1.0 and clip_coefficient(norm, 0.0) == 1.0


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 4}, "stage must be 0, 1, 2 or 3"), ({"precision": "fp8"}, "precision must be"),
    ({"bucket_size": 0}, "bucket_size"), ({"gradient_accumulation_steps": 0}, "accumulation"),
    ({"clip_grad": -1.0}, "clip_grad")])
def test_zero_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**kwargs)


def test_adamw_and_loss_scale_configs_validate():
    with pytest.raises(ValueError, match="betas"):
        AdamWConfig(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="below min_scale"):
        LossScaleConfig(initial_scale=0.5)
    assert ZeroConfig(precision="bf16").alignment_elements == 8


def test_measure_storages_deduplicates_views_and_aliases():
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:]]
    other = torch.zeros(10, dtype=torch.bfloat16)
    got = measure_storages({"param16": views, "master32": views + [other]})
    assert got["param16"] == 400 and got["master32"] == 20 and got["buffers"] == 0


def test_formulas_are_the_papers():
    psi, nd = 1000, 4
    f = {s: sum(formula_bytes(psi, s, nd, param_bytes=2, mixed_precision=True).values())
         for s in range(4)}
    assert f == {0: 16 * psi, 1: 4 * psi + 12 * psi / nd, 2: 2 * psi + 14 * psi / nd,
                 3: 16 * psi / nd}
    fp32 = formula_bytes(psi, 1, nd, param_bytes=4, mixed_precision=False)
    assert fp32 == {"param16": 4 * psi, "grad16": 4 * psi, "master32": 0, "adam_moments": 8 * psi / nd,
                    "param16_secondary": 0}   # only hpZ keeps one
    assert expected_dp_bytes(psi, 2, nd, 2) == 2 * psi * 2 * 3 / 4


def test_flat_layout_buckets_chunks_and_pieces():
    from hybrid.zero.partition import FlatLayout
    numels = [6, 3, 10, 1]
    layout = FlatLayout(numels, bucket_size=10, partitions=2, alignment=2)
    # reverse registration order; a parameter never spans buckets; buckets padded to 2 x 2
    assert [b.params for b in layout.buckets] == [(3,), (2,), (1, 0)]
    assert [b.numel for b in layout.buckets] == [4, 12, 12] and layout.numel == 28
    for rank in range(2):
        for b, piece in layout.owned_pieces(rank):
            bucket = layout.buckets[b]
            lo, _ = bucket.chunk_range(rank)
            slot = layout.slots[piece.index]
            assert slot.start + piece.param_offset == bucket.start + lo + piece.chunk_offset
    covered = [0] * len(numels)   # every element of every parameter is owned exactly once
    for rank in range(2):
        for _, piece in layout.owned_pieces(rank):
            covered[piece.index] += piece.numel
    assert covered == numels


def test_engine_rejects_misuse_with_actionable_errors():
    from hybrid.zero.factory import build_zero_optimizer
    state = ParallelState.single_process()
    with pytest.raises(ValueError, match="init_weights"):
        build_zero_optimizer(torch.nn.Linear(3, 3, device="meta"), state, ZeroConfig(), AdamWConfig())
    with pytest.raises(TypeError, match="stage 3 only"):
        build_zero_optimizer(torch.nn.Linear(3, 3), state, ZeroConfig(), AdamWConfig(), seed=1)
    model = torch.nn.Linear(3, 3)
    opt = build_zero_optimizer(model, state, ZeroConfig(stage=1, gradient_accumulation_steps=2),
                               AdamWConfig())
    opt.backward(model(torch.ones(2, 3)).sum())
    with pytest.raises(RuntimeError, match="after 1 backward"):
        opt.step()
    model.zero_grad()
    with pytest.raises(RuntimeError, match="opt.zero_grad"):
        opt.backward(model(torch.ones(2, 3)).sum())
    opt.zero_grad()
    for _ in range(2):
        opt.backward(model(torch.ones(2, 3)).sum())
    assert not opt.step().skipped and opt.step_count == 1
