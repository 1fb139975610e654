"""Shared pieces of the CUDA suite: numerics settings, the CPU oracle's run, a training loop whose
batches move to the GPU, and rank set-ups for two ranks that share one GPU.

Two ranks on one GPU: NCCL refuses them (one communicator per device), so they join a **gloo**
group and communicate CUDA tensors through it: gloo's all-reduce, broadcast, all-gather and
all-to-all stage CUDA tensors through pinned host buffers themselves (hybrid.comm keeps its
point-to-point all-gather for host tensors, see its module docstring). NCCL runs where the machine
has a GPU per rank (``nccl_reason``).
"""

from __future__ import annotations

import contextlib

import torch

from hybrid import comm
from hybrid.parallel_state import ParallelState
from hybrid.topology import Topology
from hybrid.zero.factory import build_zero_optimizer
from tests.zero.test_stages import micro_batches

# CUDA against the CPU oracle, fp32 with TF32 off: the same math in another summation order (cuBLAS,
# SDPA's fused kernels). One forward/backward agrees to ~1e-6 relative; five AdamW steps (eps 1e-4,
# lr 1e-2) move parameters by ~5e-2, so 1e-4 relative / 1e-5 absolute leaves room for rounding only.
LOSS_RTOL, PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-4, 1e-5
INIT_SEED = 11   # tests.zero.test_stages.GPTTask initialises model and reference with it


def _tf32_switches() -> list[tuple[object, str, object]]:
    """(object, attribute, full-precision value) of each TF32 switch, in the API this torch has:
    the per-backend ``fp32_precision`` (torch >= 2.9, where touching the legacy ``allow_tf32`` flags
    as well raises "mix of the legacy and new APIs"), else ``allow_tf32``."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):
        return [(matmul, "fp32_precision", "ieee"), (cudnn.conv, "fp32_precision", "ieee"),
                (cudnn.rnn, "fp32_precision", "ieee")]
    return [(matmul, "allow_tf32", False), (cudnn, "allow_tf32", False)]


@contextlib.contextmanager
def ieee_fp32():
    """fp32 matmuls and convolutions in full precision (TF32 off), restored afterwards."""
    switches = _tf32_switches()
    saved = [getattr(obj, name) for obj, name, _ in switches]
    for obj, name, value in switches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for (obj, name, _), value in zip(switches, saved):
            setattr(obj, name, value)


@contextlib.contextmanager
def bitwise_reproducible():
    """Deterministic kernels (cuBLAS with the fixed workspace of conftest.py, sorted embedding
    backward) and SDPA's math backend (the fused flash / memory-efficient backward accumulates with
    atomics): two runs of the same kernels on the same inputs give the same bits."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with ieee_fp32(), sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def nccl_reason(world_size: int) -> str | None:
    """Why NCCL cannot run ``world_size`` ranks here (None: it can)."""
    if not torch.distributed.is_nccl_available():
        return "this torch build has no NCCL"
    if torch.cuda.device_count() < world_size:
        return (f"NCCL needs one GPU per rank ({world_size} ranks, {torch.cuda.device_count()} "
                f"GPU(s)); two ranks sharing one GPU ran on gloo instead")
    return None


def rank_state(rank: int, world_size: int, tp: int, backend: str) -> ParallelState:
    """This rank's state on CUDA: ``gloo`` - every rank on GPU 0; ``nccl`` - rank r on GPU r."""
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(device)
    return ParallelState.initialize(Topology(world_size, tp, gpus_per_node=world_size),
                                    backend=backend, device=device)


def build_engine(task, state, zero_config, adamw, offload=None):
    """``task.model(state)`` under ``zero_config``. Stage 3 materialises each shard again from the
    model's ``init_parameter(name, seed)``, so it is given the task's seed."""
    model = task.model(state)
    seed = {"seed": INIT_SEED} if zero_config.stage == 3 else {}
    return model, build_zero_optimizer(model, state, zero_config, adamw, offload=offload, **seed)


def train_on_device(task, state, opt, model, data, accum: int = 1):
    """``tests.zero.test_stages.train`` with every micro-batch moved to ``state.device``:
    (DP-mean losses, StepResults)."""
    losses, results = [], []
    for batch in data:
        opt.zero_grad()
        total = torch.zeros(1, device=state.device)
        for mb in micro_batches(task, batch, state, accum):
            loss = task.loss(model, tuple(t.to(state.device) for t in mb)) / accum
            opt.backward(loss)
            total += loss.detach().float()
        results.append(opt.step())
        with comm.unrecorded(state.dp):
            comm.all_reduce(total, state.dp)
        losses.append(total.item() / state.dp_size)
    return losses, results


def trained_params(opt, model) -> dict[str, torch.Tensor]:
    """TP-local parameters on the host (stage 3 gathers them; a collective over DP)."""
    params = (opt.gathered_state_dict() if opt.config.stage == 3 else
              {n: p.detach() for n, p in model.named_parameters()})
    return {n: p.float().cpu() for n, p in params.items()}


def compare_with_reference(task, state, losses, params, ref, what: str) -> None:
    """Losses and this rank's parameter shards against the CPU oracle's run (``reference_run``)."""
    ref_losses, _, ref_params = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL,
                               atol=0, msg=lambda m: f"{what} losses: {m}")
    for name, value in params.items():
        expected = task.shard(name, ref_params[name], value, state)
        torch.testing.assert_close(value, expected, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                   msg=lambda m: f"{what} param {name}: {m}")
