"""Random-number streams of tensor parallelism (Megatron-LM §3, "random number generation").

Dropout outside the TP regions (after the row-parallel reduction, on replicated activations) must draw
the *same* mask on every TP rank, or the replicas drift apart; dropout inside a TP region (on
attention probabilities of this rank's heads) must draw *different* masks on different TP ranks, or
the heads of one layer are correlated. Hence two streams:

* the default generator, seeded with ``seed`` on every rank (TP and DP alike);
* a TP-region stream seeded ``seed + 2718 + tp_rank``, entered with ``with tracker.fork():``, which
  swaps it into the default generator for the block and swaps it back out afterwards.

``get_states``/``set_states`` capture and restore both streams, so activation recomputation
(ZeRO-R / Megatron checkpointing) reproduces the same dropout masks in the recomputed forward.
Works on CPU (``torch.get_rng_state``) and CUDA (``torch.cuda.get_rng_state(device)``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

TP_SEED_OFFSET = 2718  # Megatron's offset between the default and the TP-region seed


@dataclass
class RNGStates:
    """A snapshot of both streams; ``cuda`` is None on CPU devices."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    tp: torch.Tensor


class RNGTracker:
    """The default and the TP-region random streams of one rank on ``device``."""

    def __init__(self, seed: int, tp_rank: int, device: str | torch.device = "cpu"):
        if seed < 0 or tp_rank < 0:
            raise ValueError(f"seed and tp_rank must be non-negative, got seed={seed}, "
                             f"tp_rank={tp_rank}")
        self.seed, self.tp_rank = int(seed), int(tp_rank)
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"RNGTracker supports cpu and cuda devices, got {self.device}")
        self._tp_state = self._fresh_tp_state()
        self._inside_fork = False   # while True the device generator holds the TP stream

    @property
    def tp_seed(self) -> int:
        return self.seed + TP_SEED_OFFSET + self.tp_rank

    def _is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _fresh_tp_state(self) -> torch.Tensor:
        """A generator state of this device's kind, seeded with ``tp_seed``."""
        generator = torch.Generator(device=self.device).manual_seed(self.tp_seed)
        return generator.get_state()

    def _get_device_state(self) -> torch.Tensor:
        if self._is_cuda():
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_device_state(self, state: torch.Tensor) -> None:
        if self._is_cuda():
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def seed_all(self) -> None:
        """Seed the default generators (CPU and every CUDA device) with ``seed`` and reset the
        TP-region stream: the start of a run."""
        self._require_outside_fork("seed_all()")
        torch.manual_seed(self.seed)
        self._tp_state = self._fresh_tp_state()

    @contextlib.contextmanager
    def fork(self):
        """Run the block on the TP-region stream (differs across TP ranks), then restore the
        default stream exactly where it was."""
        self._require_outside_fork("tracker.fork() is not re-entrant")
        outside = self._get_device_state()
        self._set_device_state(self._tp_state)
        self._inside_fork = True
        try:
            yield
        finally:
            self._inside_fork = False
            self._tp_state = self._get_device_state()
            self._set_device_state(outside)

    def _require_outside_fork(self, what: str) -> None:
        if self._inside_fork:
            raise RuntimeError(f"{what}: the block is already inside tracker.fork(), where the "
                               f"default generator holds the TP-region stream; call it outside")

    def get_states(self) -> RNGStates:
        """Snapshot of the default CPU (and CUDA) generator and of the TP-region stream."""
        self._require_outside_fork("get_states()")
        cuda = torch.cuda.get_rng_state(self.device) if self._is_cuda() else None
        return RNGStates(torch.get_rng_state(), cuda, self._tp_state.clone())

    def set_states(self, states: RNGStates) -> None:
        """Restore a snapshot taken by :meth:`get_states`."""
        self._require_outside_fork("set_states()")
        torch.set_rng_state(states.cpu)
        if self._is_cuda():
            if states.cuda is None:
                raise ValueError("these RNG states were captured on CPU; they carry no CUDA state")
            torch.cuda.set_rng_state(states.cuda, self.device)
        self._tp_state = states.tp.clone()
