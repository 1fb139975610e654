"""Offload configuration and the host-memory budget (ZeRO-Offload §4, ZeRO-Infinity §5).

``--offload-optimizer none|cpu|nvme`` chooses where the fp32 master and Adam moments live;
``--host-memory-budget 4GiB`` caps the resident memory of each rank. With ``nvme`` the budget sets
the size of the two streaming block buffers (32 bytes per block element: master, two moments and a
gradient block, two buffers) so that what stays resident - the device-side model states (16-bit
parameters and gradients, which on a CPU-only run are host memory too), communication buffers
and the runtime's own footprint - plus the buffers fits; ``cpu`` must hold 12 bytes per owned
parameter and is refused when that cannot fit. With ``--offload-params nvme`` (ZeRO-3) the
engine counts the parameter store's buffers (:func:`hybrid.offload.param_store.resident_bytes`)
instead of the 16-bit partitions. :func:`build_offload_state` is what the ZeRO engines call.

A budget also fixes glibc's mmap threshold (:func:`return_freed_buffers_to_os`, which the trainer
calls before it builds the model; code that builds engines itself calls it first): by default glibc
serves allocations below an adaptive threshold (up to 32 MiB) from a heap it rarely shrinks, and
ZeRO-3 allocates and frees each unit's gathered parameters and gradients every step, so the
resident set drifts GBs above the live tensors (measured on a 170M-parameter fp32 GPT with its
parameters on NVMe: a peak of 2.6-3.1 GB instead of 1.25 GB).
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass

import torch

from hybrid.adamw_config import OFFLOAD_MOMENTS_REFUSAL, AdamWConfig
from hybrid.offload.cpu_adam import KERNELS, CPUAdamW

log = logging.getLogger(__name__)
MODES = ("none", "cpu", "nvme")
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
RUNTIME_ALLOWANCE = 400 * 2**20   # python + torch libraries + autograd/activations of small runs
NVME_BYTES_PER_BLOCK_ELEM = 2 * 4 * 4
MIN_BLOCK, MAX_BLOCK = 1 << 14, 1 << 20   # above 1M elements (4 MB a tensor) nothing gets faster
BLOCKS_PER_PARTITION = 4   # a larger block buys no overlap: the I/O of one block hides behind 3
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 1 << 20   # glibc mallopt parameter; 1 MiB and up: mmap


def parse_bytes(text: str | int) -> int:
    """'4GiB', '1.5 GB', '512MiB', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 4GiB, 1.5GB or 512MiB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


@dataclass
class OffloadConfig:
    """Where optimizer state lives. ``block_elems`` 0 = chosen from the budget (or a default)."""

    mode: str = "none"
    nvme_path: str | None = None
    host_memory_budget: int | None = None
    block_elems: int = 0
    kernel: str = "fused"
    params: str = "none"     # "nvme": ZeRO-3 parameter partitions in hybrid.offload.param_store

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--offload-optimizer must be one of {MODES}, got {self.mode!r}")
        if self.mode == "nvme" and not self.nvme_path:
            raise ValueError("--offload-optimizer nvme needs --offload-nvme-path DIR (a directory "
                             "on a fast local disk) for the optimizer-state files")
        if self.host_memory_budget is not None:
            self.host_memory_budget = parse_bytes(self.host_memory_budget)
            if self.host_memory_budget <= 0:
                raise ValueError("--host-memory-budget must be positive")
        if self.block_elems < 0:
            raise ValueError(f"block_elems must be >= 0 (0 = automatic), got {self.block_elems}")
        if self.kernel not in KERNELS:
            raise ValueError(f"CPU Adam kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.params not in ("none", "nvme"):
            raise ValueError(f"--offload-params must be none or nvme, got {self.params!r}")
        if self.params == "nvme" and self.mode != "nvme":
            raise ValueError("--offload-params nvme keeps the ZeRO-3 parameter partitions beside "
                             "the optimizer state on NVMe: add --offload-optimizer nvme "
                             "--offload-nvme-path DIR")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


def plan_block_elems(config: OffloadConfig, owned_numel: int, resident_bytes: int) -> int:
    """Block size for the CPU Adam / NVMe streaming so the rank stays under the budget.

    ``resident_bytes``: what the engine keeps in host memory anyway (device model states on a CPU
    run, buffers). Raises a ValueError naming the shortfall when the budget cannot be met."""
    if config.block_elems:
        return config.block_elems
    # NVMe buffers larger than a quarter of the partition buy no overlap, only resident memory
    cap = min(MAX_BLOCK, max(MIN_BLOCK, -(-owned_numel // BLOCKS_PER_PARTITION)))
    budget = config.host_memory_budget
    if budget is None:
        return cap if config.mode == "nvme" else MAX_BLOCK
    free = budget - resident_bytes - RUNTIME_ALLOWANCE
    if config.mode == "cpu":
        need = 12 * owned_numel
        if need > free:
            raise ValueError(f"--offload-optimizer cpu keeps {need / 2**30:.2f} GiB of optimizer "
                             f"state in host memory but the budget leaves {free / 2**30:.2f} GiB; use "
                             f"--offload-optimizer nvme, more DP ranks or a larger budget")
        return MAX_BLOCK
    block = free // (2 * NVME_BYTES_PER_BLOCK_ELEM)    # half of what is left, two buffers
    if block < MIN_BLOCK:
        raise ValueError(f"--host-memory-budget {budget / 2**30:.2f} GiB cannot hold this rank's "
                         f"resident model states ({resident_bytes / 2**30:.2f} GiB) plus "
                         f"{RUNTIME_ALLOWANCE / 2**20:.0f} MiB runtime and the NVMe buffers; raise "
                         f"the budget, use more DP ranks, ZeRO stage 3 or, at stage 3, "
                         f"--offload-params nvme")
    return int(min(block, cap))


def build_offload_state(config: OffloadConfig, sizes: list[int],
                        decay_ranges: list[list[tuple[int, int]]], adamw: AdamWConfig, *,
                        device: torch.device, param_dtype: torch.dtype, rank: int,
                        resident_bytes: int):
    """The optimizer-state backend a ZeRO engine delegates master weights and AdamW to."""
    from hybrid.offload.host_state import HostOptimizerState
    from hybrid.offload.nvme import NVMeOptimizerState
    if not config.enabled:
        raise ValueError("build_offload_state needs --offload-optimizer cpu or nvme")
    if adamw.low_precision_moments:
        raise ValueError(OFFLOAD_MOMENTS_REFUSAL)
    block = plan_block_elems(config, sum(sizes), resident_bytes)
    adam = CPUAdamW(adamw, kernel=config.kernel, block_elems=block)
    if config.mode == "cpu":
        return HostOptimizerState(sizes, decay_ranges, adam, device=device, param_dtype=param_dtype)
    return NVMeOptimizerState(sizes, decay_ranges, adam, device=device, param_dtype=param_dtype,
                              directory=config.nvme_path, rank=rank)


def return_freed_buffers_to_os(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have glibc map every allocation of ``threshold`` bytes or more on its own, so that freeing it
    unmaps it (module docstring). Setting the threshold also stops glibc from raising it. Process
    wide and idempotent; False (nothing changed) where the C library is not glibc."""
    try:
        done = bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        done = False
    log.debug("glibc mmap threshold %s %d bytes", "fixed at" if done else "not set to", threshold)
    return done
