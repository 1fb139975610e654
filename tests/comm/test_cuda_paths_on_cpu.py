"""The parts of the CUDA-path review (docs/gpu.md, "CUDA paths reviewed") that can be checked on a
CPU machine, by making torch report a GPU where the code only asks:

* ``cuda`` without an index becomes ``cuda:<current>`` for the parallel state, the MD arena and the
  activation meter, which compare devices with the ``cuda:N`` that tensors report;
* a process group joined with gloo keeps gloo (and CPU tensors) for its TP and DP subgroups on a
  machine that also has GPUs, instead of switching them to NCCL.
"""

from __future__ import annotations

import torch

from hybrid.parallel_state import ParallelState, concrete_device
from hybrid.recompute import ActivationMeter, Arena
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology


def test_cuda_devices_get_their_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert concrete_device("cuda") == torch.device("cuda", 1)
    assert concrete_device("cuda:0") == torch.device("cuda", 0)
    assert concrete_device("cpu") == torch.device("cpu")
    assert ParallelState.single_process("cuda").device == torch.device("cuda", 1)
    assert Arena("a", 1024, "cuda").device == torch.device("cuda", 1)   # allocates lazily
    assert ActivationMeter(device="cuda").device == torch.device("cuda", 1)


def _pretend_gpus(rank, world_size):
    torch.cuda.is_available = lambda: True   # this spawned rank only
    state = ParallelState.initialize(Topology(world_size, 2, gpus_per_node=world_size))
    t = torch.ones(3) * (rank + 1)
    from hybrid import comm
    comm.all_reduce(t, state.tp)
    return str(state.device), torch.distributed.get_backend(state.tp.pg), t.tolist()


def test_subgroups_keep_the_default_groups_backend_on_a_gpu_machine():
    results = run_on_ranks(_pretend_gpus, 2)
    assert results == [("cpu", "gloo", [3.0, 3.0, 3.0])] * 2
