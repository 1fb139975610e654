"""Regional torch.compile of the transformer layers (models/gpt/compile.py) trains like eager: the same
tiny GPT, data and ZeRO engine, 5 steps eager then 5 steps compiled on the same ranks, losses and
final parameters compared (fp32 rtol 1e-5; 16-bit within BF16_RTOL but for isolated AdamW
sign flips, see docs/compile.md), across TP 1/2
(TP 2 with sequence parallelism) x ZeRO stages 0-3 x recompute modes. The comm ledger is identical
(the TP collectives graph-break and run eagerly, once each), and so is ZeRO-3's trace of gathers,
releases and reductions (its hooks stay on the layer modules, neither bypassed nor doubled).

Inductor's C++ compile takes tens of seconds per graph on a small CPU, so every test of the module
shares one cache directory (warm after the first compile of each graph): two cases run in the default
suite, the rest are marked slow.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.recompute import RecomputePlan
from hybrid.testing.multirank import run_on_ranks
from hybrid.testing.subprocesses import child_env
from hybrid.topology import Topology
from hybrid.zero.config import ZeroConfig
from hybrid.zero.factory import build_zero_optimizer
from models.gpt.compile import compile_layers
from models.gpt.config import GPTConfig
from models.gpt.model import GPTModel
from tests.reliability_helpers import ROOT
from tests.training_helpers import SEQ, make_trainer, tiny_args
from tests.zero.test_stages import GPTTask

STEPS, INIT_SEED = 5, 11
BF16_RTOL = 2e-2          # bf16 keeps 8 mantissa bits: fused vs unfused rounding differs by ulps
BF16_OUTLIERS = 1e-3      # share of 16-bit parameter elements allowed beyond BF16_RTOL (sign flips)


class CompileTask(GPTTask):
    """GPTTask at the trainer tests' sequence length (16): the layer graph [16, 8, 32] of the TP 1
    case is the trainer test's too, so the module's warm cache serves both."""

    config = GPTConfig(2, 32, 4, vocab_size=101, seq_length=SEQ, hidden_dropout=0.0,
                       attention_dropout=0.0, make_vocab_size_divisible_by=4)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """The module's --data-cache-dir: inductor's cache is its ``inductor`` folder, as in the trainer."""
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def cache_dir(cache_root):
    return str(cache_root / "inductor")


def _train(state, task, data, stage, precision, recompute, compiled, cache_dir):
    plan = None if recompute == "none" else RecomputePlan.uniform(recompute, task.config.num_layers)
    model = GPTModel(task.config, state, device="meta", sequence_parallel=task.sequence_parallel,
                     recompute=plan)
    if stage < 3:
        model.init_weights(INIT_SEED)
    if compiled:
        compile_layers(model, cache_dir=cache_dir)
    cfg = ZeroConfig(stage=stage, precision=precision, bucket_size=300)
    opt = build_zero_optimizer(model, state, cfg, task.adamw,
                               **(dict(seed=INIT_SEED) if stage == 3 else {}))
    mark, losses = state.ledger.position, []
    for tokens, labels in data:
        opt.zero_grad()
        rows = slice(state.dp_rank * len(tokens) // state.dp_size,
                     (state.dp_rank + 1) * len(tokens) // state.dp_size)   # this DP rank's samples
        loss = model(tokens[rows], labels[rows]).float().mean()
        opt.backward(loss)
        opt.step()
        total = loss.detach().clone()
        with comm.unrecorded(state.dp):   # the loss average is not the engine's traffic
            comm.all_reduce(total, state.dp)
        losses.append(total.item() / state.dp_size)
    collectives = [(r.group, r.op, r.numel) for r in state.ledger.since(mark)]
    # stage 3: the gather / release / reduce events of the last step, in order
    hooks = list(opt.scheduler.trace) if stage == 3 else None
    params = opt.gathered_state_dict() if stage == 3 else {
        n: p.detach().float().clone() for n, p in model.named_parameters()}
    return losses, params, collectives, hooks


def _compiled_vs_eager(rank, world_size, tp, sequence_parallel, cases, cache_dir):
    torch._inductor.config.compile_threads = 1   # no worker pool: each rank has one core at most
    state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
    task = CompileTask(sequence_parallel=sequence_parallel)
    data = task.data(steps=STEPS)
    for stage, precision, recompute in cases:
        what = (f"tp {tp} sp {sequence_parallel} dp {state.dp_size} stage {stage} {precision} "
                f"recompute {recompute}")
        eager = _train(state, task, data, stage, precision, recompute, False, cache_dir)
        compiled = _train(state, task, data, stage, precision, recompute, True, cache_dir)
        rtol, atol = (1e-5, 1e-6) if precision == "fp32" else (BF16_RTOL, BF16_RTOL)
        torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]), rtol=rtol,
                                   atol=atol, msg=lambda m: f"{what} losses: {m}")
        assert compiled[1].keys() == eager[1].keys()
        if precision == "fp32":
            for name, p in eager[1].items():
                torch.testing.assert_close(compiled[1][name], p, rtol=rtol, atol=atol,
                                           msg=lambda m: f"{what} {name}: {m}")
        else:
            _assert_16bit_parameters_close(compiled[1], eager[1], what)
        assert compiled[2] == eager[2], f"{what}: the TP/DP collectives differ under compile"
        assert compiled[3] == eager[3], f"{what}: ZeRO-3's hooks ran differently under compile"
    return len(cases)


def _assert_16bit_parameters_close(compiled: dict, eager: dict, what: str) -> None:
    """Every parameter within BF16_RTOL (rtol and atol) but for isolated elements, at most
    BF16_OUTLIERS of them: AdamW turns an ulp-level sign flip of a near-zero gradient element into
    a whole learning-rate step of that element (measured: 1 of 4,096 in ``fc1.weight``); and the
    whole model within BF16_RTOL relative distance. A wrong graph moves far more than that."""
    c = torch.cat([compiled[name].flatten() for name in eager])
    e = torch.cat([p.flatten() for p in eager.values()])
    outliers = int((~torch.isclose(c, e, rtol=BF16_RTOL, atol=BF16_RTOL)).sum())
    assert outliers <= BF16_OUTLIERS * e.numel(), f"{what}: {outliers} of {e.numel()} elements apart"
    gap = float((c - e).norm() / e.norm())
    assert gap <= BF16_RTOL, f"{what}: parameters at relative distance {gap:.3g}"


def _run(tp, cases, cache_dir, world_size=2, sequence_parallel=False):
    done = run_on_ranks(_compiled_vs_eager, world_size,
                        args=(tp, sequence_parallel, cases, cache_dir), timeout=900)
    assert done == [len(cases)] * world_size


@pytest.mark.slow   # 45 s of compiling
def test_tp1_zero0_fp32_matches_eager(cache_dir):
    _run(1, [(0, "fp32", "none")], cache_dir, world_size=1)


@pytest.mark.slow   # CI budget (35 s of compiling); the default set keeps the MoE fp32 trace check
def test_tp2_zero3_selective_recompute_matches_eager(cache_dir):
    # without SP: 4 collectives per layer, 5 compiled regions (SP, in the slow matrix, has ~11)
    _run(2, [(3, "fp32", "selective")], cache_dir)


# (stage, precision, recompute): every stage, every recompute mode, both 16-bit formats
MATRIX = [(0, "fp32", "full"), (1, "fp32", "selective"), (2, "fp32", "full-pa"),
          (3, "fp32", "full-pa-cpu"), (1, "bf16", "none"), (3, "bf16", "full"),
          (2, "fp16", "selective")]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_compiled_matches_eager_matrix(cache_dir, tp):
    _run(tp, MATRIX, cache_dir, world_size=2 * tp, sequence_parallel=tp > 1)   # DP 2


# ---- the trainer's --compile -------------------------------------------------------------------
def _trainer_runs(rank, world_size, runs, cache_parent):
    """3 steps of the trainer per ``(compiled, tensorboard_dir)`` of ``runs``, in order, on
    CompileTask's layer shapes ([16, 8, 32] fp32: the graph of the TP 1 parity test, so a warm
    cache serves it); per run: losses, compile seconds and cache counts (None when eager)."""
    torch._inductor.config.compile_threads = 1
    out = []
    for compiled, tensorboard_dir in runs:
        args = tiny_args(iters=3, extra=["--micro-batch-size", "8", "--global-batch-size", "8",
                                         "--data-cache-dir", cache_parent,
                                         "--tensorboard-dir", tensorboard_dir]
                         + (["--compile"] if compiled else []))
        trainer = make_trainer(args)
        trainer.train()
        trainer.metrics.close()
        clock = trainer.compile_clock
        out.append((trainer.losses, clock and clock.seconds, clock and clock.cache_counts()))
    return out


def _start(runs, cache_parent):
    """Trainer runs in one fresh process (nothing compiled in its memory yet)."""
    runs = [(compiled, str(tensorboard_dir)) for compiled, tensorboard_dir in runs]
    return run_on_ranks(_trainer_runs, 1, args=(runs, cache_parent), timeout=900)[0]


def _compile_times(run_dir) -> list[float]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars("compile-time")]


@pytest.mark.slow   # CI budget
def test_trainer_compile_flag_trains_like_eager(cache_root, tmp_path):
    cache_parent = str(cache_root)
    eager, (losses, seconds, _) = _start([(False, tmp_path / "eager"),
                                          (True, tmp_path / "compiled")], cache_parent)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager[0]), rtol=1e-5, atol=1e-6)
    assert seconds > 0
    (run_dir,) = (tmp_path / "compiled").iterdir()
    assert _compile_times(run_dir)[-1] == pytest.approx(seconds)
    assert list((Path(cache_parent) / "inductor").iterdir()), "nothing cached under --data-cache-dir"


@pytest.mark.slow
def test_second_start_reuses_the_compile_cache(tmp_path):
    """Two fresh processes on one cache directory: the first compiles (misses), the second only
    traces and loads every graph from inductor's cache (hits, no miss) and spends less time."""
    (cold,) = _start([(True, tmp_path / "a")], str(tmp_path / "c"))
    (warm,) = _start([(True, tmp_path / "b")], str(tmp_path / "c"))
    assert cold[2]["miss"] > 0 and warm[2] == {"hit": cold[2]["miss"], "miss": 0}
    assert warm[0] == cold[0]
    assert warm[1] < cold[1], f"warm start compiled for {warm[1]:.1f} s, cold {cold[1]:.1f} s"


def test_compile_without_a_cpp_compiler_is_one_error_line(tmp_path):
    """Found at launch, before any data or model is built: one ``error:`` line, exit code 2."""
    run = subprocess.run([sys.executable, "launch/pretrain_gpt.py", "--compile", "--train-iters", "1",
                          "--data-cache-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=child_env(CXX="no-such-compiler"))
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --compile on CPU needs a C++ compiler"), \
        run.stderr
    assert "'no-such-compiler'" in lines[0] and "Traceback" not in run.stderr


def _dropout_recompute(rank, world_size, tp, cache_dir):
    """Compiled layers with dropout: full recompute must redraw the forward's masks (inductor draws
    its own random numbers, seeded from the generators that the checkpoint saves and restores)."""
    from hybrid.tensor_parallel import RNGTracker
    torch._inductor.config.compile_threads = 1
    state = ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size))
    config = CompileTask.config.replace(hidden_dropout=0.1, attention_dropout=0.1)
    tokens, labels = CompileTask().data(steps=1)[0]
    grads, losses = [], []
    for recompute in (None, RecomputePlan.uniform("full", config.num_layers)):
        rng = RNGTracker(7, state.tp_rank, state.device)
        rng.seed_all()
        model = GPTModel(config, state, sequence_parallel=tp > 1, rng=rng, recompute=recompute)
        compile_layers(model, cache_dir=cache_dir)
        loss = model(tokens, labels).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert losses[0] == losses[1]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)
    return losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_dropout_masks_survive_full_recompute(cache_dir, tp):
    run_on_ranks(_dropout_recompute, tp, args=(tp, cache_dir), timeout=900)
