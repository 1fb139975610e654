"""Optimizer-state offload for every ZeRO stage: ZeRO-Offload (Ren et al. 2021; fp32 master and Adam
moments in host memory, updated by a CPU Adam) and ZeRO-Infinity (Rajbhandari et al. 2021; the same
state in files on NVMe, streamed through fixed-size buffers), under a host-memory budget.

:mod:`.backend` the interface every optimizer-state backend implements (the on-device one
included, :mod:`hybrid.zero.optimizer_state`), :mod:`.cpu_adam` the host AdamW kernel,
:mod:`.host_state` host-memory backend and device transfers, :mod:`.nvme` file-backed backend, :mod:`.param_store` stage-3 parameter partitions on NVMe
(ZeRO-Infinity parameter offload), :mod:`.budget` configuration and buffer sizing.
"""

from hybrid.offload.backend import OptimizerStateBackend
from hybrid.offload.budget import OffloadConfig, build_offload_state, parse_bytes, plan_block_elems
from hybrid.offload.cpu_adam import CPUAdamW
from hybrid.offload.host_state import HostOptimizerState
from hybrid.offload.nvme import NVMeOptimizerState
from hybrid.offload.param_store import NVMeParamStore

__all__ = ["CPUAdamW", "HostOptimizerState", "NVMeOptimizerState", "NVMeParamStore",
           "OffloadConfig", "OptimizerStateBackend", "build_offload_state", "parse_bytes",
           "plan_block_elems"]
