"""Where a rank's fp32 master weights and Adam moments live, and how AdamW runs on them: the one
interface a ZeRO engine holds its optimizer state through (ZeRO §5.1 Pos; ZeRO-Offload, Ren et al.
2021; ZeRO-Infinity, Rajbhandari et al. 2021).

Three backends implement :class:`OptimizerStateBackend`:

* :class:`hybrid.zero.optimizer_state.DeviceOptimizerState`: on the training device (no offload);
* :class:`hybrid.offload.host_state.HostOptimizerState`: in host memory, updated by the CPU AdamW;
* :class:`hybrid.offload.nvme.NVMeOptimizerState`: in a file on NVMe, streamed through two host
  buffers, updated by the CPU AdamW.

The engine picks one when it is built (:func:`hybrid.zero.optimizer_state.build_optimizer_state`)
and never asks which it holds. A partition is a list of flat chunks (one per bucket of stages 0-2,
one per unit of stage 3); ``params_out`` is the engine's list of this rank's parameter chunks in
the training dtype (for stage 3 with parameters on NVMe: the parameter store's writer, which takes
the chunks in increasing order).

This module sits in ``hybrid.offload`` because ``hybrid.zero`` may import ``hybrid.offload`` and
not the reverse (docs/design.md §Architecture); the device backend, which needs ZeRO's AdamW
kernels, lives in ``hybrid.zero``.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")   # the checkpoint kinds of optimizer state


class OptimizerStateBackend(Protocol):
    """fp32 master + Adam moments of a rank's partition, and the AdamW step on them."""

    step: int   # AdamW steps taken (the checkpoint's step count; the bias corrections read it)

    def write_master(self, chunk: int, offset: int, values: torch.Tensor) -> None:
        """Initial master values for elements [offset, +numel) of ``chunk`` (any float dtype)."""
        ...

    def accept_grad(self, chunk: int, grad: torch.Tensor) -> None:
        """``chunk``'s reduced gradient of the step's last micro-batch is final: a backend that
        moves gradients off the device starts moving it now, during backward (the device backend
        reads it where it is, at the step)."""
        ...

    def drop_staged_grads(self) -> None:
        """Forget what :meth:`accept_grad` staged (the gradients were zeroed or the step skipped)."""
        ...

    def update(self, grads: list[torch.Tensor], params_out: Sequence[torch.Tensor], *, lr: float,
               grad_scale: float, skip: torch.Tensor | None = None) -> None:
        """One AdamW step on the whole partition: ``grads`` (per chunk, the gradient's dtype, still
        multiplied by ``grad_scale``) divided by ``grad_scale``; the updated master, in the
        parameter dtype, left in ``params_out``. fp32 gradients may be modified in place.
        ``skip``: a 0-dim bool tensor; where set, the step changes nothing. A backend with
        ``skips_on_device`` decides that on the device (``grad_scale`` may then be a 0-dim tensor);
        the engine calls the others only for the steps it takes."""
        ...

    def publish(self, params_out: Sequence[torch.Tensor]) -> None:
        """Write the master, in the parameter dtype, into ``params_out`` (after a checkpoint load)."""
        ...

    def fragment_views(self, kind: str) -> list[torch.Tensor]:
        """Per-chunk 1-D tensors of ``kind`` (one of :data:`STATE_KINDS`) that a checkpoint reads
        and writes in place."""
        ...

    def resident(self) -> dict[str, list[torch.Tensor]]:
        """Storages this backend keeps in memory, by memory-report category: ``master32``,
        ``adam_moments`` and ``buffers``."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The resident Adam-moment storages."""
        ...

    def close(self) -> None:
        """Release files and threads (nothing for in-memory backends)."""
        ...
