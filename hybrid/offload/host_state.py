"""Optimizer state in host memory: ZeRO-Offload (Ren et al. 2021, §4) for every ZeRO stage.

The fp32 master partition and both Adam moments of this rank live in host memory (12 bytes per
owned parameter, pinned when the model is on a GPU). Each optimizer step walks the partition block
by block: the block's reduced fp32 gradient comes to the host, the CPU Adam updates it in place and
writes the new values in the parameter dtype into a staging buffer that goes back to the device.

On CUDA, :class:`DeviceLink` double-buffers both directions in pinned memory on two side streams, so
the gradient copy of block i+1 and the parameter copy of block i-1 run while block i is updated. On
CPU "device" and host are the same memory: gradients are read where they are and the update writes
straight into the parameter partition (no copies) - the same interfaces, tested on CPU.

Gradients stream to the host as they become final (ZeRO-Offload §4.2): the engine calls
``accept_grad(chunk, grad)`` as soon as a chunk's reduced gradient of the step's last micro-batch
has landed, during backward. On CUDA that starts a non-blocking copy into a pinned fp32 host slot of
the chunk on the D2H side stream, overlapping the rest of backward; on CPU it converts/copies into
the same host fp32 slot. ``update`` then uses the staged chunks (waiting only for their copies) and
fetches the others from ``grads`` as before; ``drop_staged_grads()`` forgets them (skipped step).

:class:`HostOptimizerState` is one of the three implementations of
:class:`hybrid.offload.backend.OptimizerStateBackend`, through which the ZeRO engines hold their
optimizer state. A partition is a list of flat chunks (one per bucket or unit); ``decay_ranges[c]``
lists the (offset, numel) pieces of chunk c with weight decay.
"""

from __future__ import annotations

import torch

from hybrid.offload.backend import STATE_KINDS, OptimizerStateBackend
from hybrid.offload.cpu_adam import CPUAdamW


class DeviceLink:
    """Block transfers between the device partition and host memory (see module docstring)."""

    def __init__(self, device: torch.device, block_elems: int, param_dtype: torch.dtype):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:   # two pinned slots per direction, one side stream per direction
            self.d2h, self.h2d = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
            self.grad_slots = [torch.empty(block_elems, dtype=torch.float32, pin_memory=True)
                               for _ in range(2)]
            self.out_slots = [torch.empty(block_elems, dtype=param_dtype, pin_memory=True)
                              for _ in range(2)]
            self.grad_ready = [torch.cuda.Event() for _ in range(2)]
            self.out_free = [torch.cuda.Event() for _ in range(2)]

    def fetch_grad(self, grad_block: torch.Tensor, slot: int) -> torch.Tensor:
        """Start moving a device gradient block to the host; returns where it will be."""
        if not self.cuda:
            return grad_block if grad_block.dtype == torch.float32 else grad_block.float()
        host = self.grad_slots[slot][:grad_block.numel()]
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            host.copy_(grad_block, non_blocking=True)
            self.grad_ready[slot].record(self.d2h)
        return host

    def wait_grad(self, slot: int) -> None:
        if self.cuda:
            self.grad_ready[slot].synchronize()

    def copy_to_host(self, host: torch.Tensor, grad: torch.Tensor):
        """Start copying ``grad`` (device, any float dtype) into host fp32 ``host``; returns the
        CUDA event that marks its end (None on CPU, where the copy is done on return)."""
        if not (self.cuda and grad.is_cuda):
            host.copy_(grad.reshape(-1))
            return None
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))   # backward wrote it there
        with torch.cuda.stream(self.d2h):
            host.copy_(grad.reshape(-1), non_blocking=True)
            grad.record_stream(self.d2h)   # the engine may free or reuse it before the copy ends
            done = torch.cuda.Event()
            done.record(self.d2h)
        return done

    def out_buffer(self, param_block: torch.Tensor, slot: int) -> torch.Tensor:
        """Host memory the updated block is written into: the parameter itself when it is in host
        memory (a CPU run, or a partition held by hybrid.offload.param_store)."""
        if not param_block.is_cuda:
            return param_block
        self.out_free[slot].synchronize()      # the previous copy from this slot has finished
        return self.out_slots[slot][:param_block.numel()]

    def push(self, host_block: torch.Tensor, param_block: torch.Tensor, slot: int) -> None:
        """Send the updated host block to the device parameter partition (async on CUDA)."""
        if not param_block.is_cuda:
            if host_block.data_ptr() != param_block.data_ptr():
                param_block.copy_(host_block)
            return
        # the current stream may still read the parameters (the end of backward, a gather)
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d):
            param_block.copy_(host_block, non_blocking=True)
            self.out_free[slot].record(self.h2d)

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)

    def buffers(self) -> list[torch.Tensor]:
        return self.grad_slots + self.out_slots if self.cuda else []


def blocks_of(sizes: list[int], block_elems: int) -> list[tuple[int, int, int]]:
    """(chunk, lo, hi) blocks of at most ``block_elems`` covering every chunk in order."""
    return [(c, lo, min(size, lo + block_elems)) for c, size in enumerate(sizes)
            for lo in range(0, size, block_elems)]


def check_grads_available(grads, sizes: list[int], staged) -> None:
    """Refuse an update (before it changes anything) when a chunk has no gradient at all."""
    if grads is None:
        missing = [c for c in range(len(sizes)) if not staged(c)]
        if missing:
            raise ValueError(f"chunk {missing[0]} has no staged gradient and update() got no grads")


def ranges_in(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of (offset, numel) ``ranges`` inside [lo, hi), relative to lo."""
    out = []
    for start, numel in ranges:
        a, b = max(start, lo), min(start + numel, hi)
        if a < b:
            out.append((a - lo, b - a))
    return out


class HostGradStage:
    """Reduced gradients staged in host fp32 memory chunk by chunk as backward finalises them
    (allocated on the first :meth:`accept`: 4 bytes per owned element, pinned on CUDA)."""

    def __init__(self, sizes: list[int], link: DeviceLink):
        self.sizes, self.link = list(sizes), link
        self.flat: torch.Tensor | None = None
        self.chunks: list[torch.Tensor] = []
        self.events: dict[int, object] = {}

    def accept(self, chunk: int, grad: torch.Tensor) -> None:
        if grad.numel() != self.sizes[chunk]:
            raise ValueError(f"gradient of chunk {chunk} has {grad.numel()} elements, the "
                             f"partition's chunk has {self.sizes[chunk]}")
        if self.flat is None:
            self.flat = torch.empty(sum(self.sizes), dtype=torch.float32, pin_memory=self.link.cuda)
            self.chunks = list(torch.split(self.flat, self.sizes))
        self.events[chunk] = self.link.copy_to_host(self.chunks[chunk], grad)

    def staged(self, chunk: int) -> bool:
        return chunk in self.events

    def view(self, chunk: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of a staged chunk, once its copy has landed."""
        event = self.events[chunk]
        if event is not None:
            event.synchronize()
        return self.chunks[chunk][lo:hi]

    def clear(self) -> None:
        self.events.clear()

    def buffers(self) -> list[torch.Tensor]:
        return [] if self.flat is None else [self.flat]


class HostOptimizerState(OptimizerStateBackend):
    """fp32 master + Adam moments of a partition (chunk ``sizes``) in host memory."""

    def __init__(self, sizes: list[int], decay_ranges: list[list[tuple[int, int]]], adam: CPUAdamW,
                 *, device: torch.device, param_dtype: torch.dtype):
        if len(decay_ranges) != len(sizes):
            raise ValueError("decay_ranges needs one list of (offset, numel) per chunk")
        self.sizes, self.decay_ranges, self.adam = list(sizes), decay_ranges, adam
        pin = torch.device(device).type == "cuda"
        total = sum(sizes)
        # master alone, both moments in one storage (as the NVMe file holds them back to back)
        self.master = torch.zeros(total, dtype=torch.float32, pin_memory=pin)
        self.moments = torch.zeros(2 * total, dtype=torch.float32, pin_memory=pin)
        self.flat = {"master": self.master, "exp_avg": self.moments[:total],
                     "exp_avg_sq": self.moments[total:]}
        self.chunks = {k: list(torch.split(t, self.sizes)) if sizes else []
                       for k, t in self.flat.items()}
        self.link = DeviceLink(device, adam.block_elems, param_dtype)
        self.staged = HostGradStage(self.sizes, self.link)
        self.step = 0

    def write_master(self, chunk: int, offset: int, values: torch.Tensor) -> None:
        """Initial (or loaded) master values for elements [offset, +numel) of ``chunk``."""
        self.chunks["master"][chunk][offset:offset + values.numel()].copy_(values.reshape(-1))

    def accept_grad(self, chunk: int, grad: torch.Tensor) -> None:
        """Stage ``chunk``'s final reduced gradient (still to be divided by the ``grad_scale`` of
        the next :meth:`update`) in host memory; see the module docstring."""
        self.staged.accept(chunk, grad)

    def drop_staged_grads(self) -> None:
        """Forget the staged gradients (the step is skipped)."""
        self.staged.clear()

    def update(self, grads: list[torch.Tensor] | None, params_out: list[torch.Tensor], *,
               lr: float, grad_scale: float = 1.0, skip: torch.Tensor | None = None) -> None:
        """AdamW on the whole partition; every gradient is divided by ``grad_scale`` first. A
        chunk's gradient is the staged one (:meth:`accept_grad`) or else ``grads[c]`` (on the
        device, any float dtype: each block is converted as it moves; None when every chunk is
        staged). Updated values go into ``params_out`` (per chunk). fp32 gradients may be modified
        in place."""
        if skip is not None and bool(skip):   # a host step: the flag is read here
            return
        check_grads_available(grads, self.sizes, self.staged.staged)
        self.step += 1
        blocks = blocks_of(self.sizes, self.adam.block_elems)
        fetch = lambda i: self._grad_block(grads, blocks[i], i % 2)   # noqa: E731
        pending = fetch(0) if blocks else None
        for i, (c, lo, hi) in enumerate(blocks):
            host_grad, slot = pending, i % 2
            if i + 1 < len(blocks):   # next block's gradient moves while this one is updated
                pending = fetch(i + 1)
            if not self.staged.staged(c):
                self.link.wait_grad(slot)
            out = self.link.out_buffer(params_out[c][lo:hi], slot)
            state = [self.chunks[k][c][lo:hi] for k in STATE_KINDS]
            self.adam.step_(state[0], host_grad, state[1], state[2],
                            ranges_in(self.decay_ranges[c], lo, hi), step=self.step, lr=lr, out=out,
                            grad_scale=grad_scale)
            self.link.push(out, params_out[c][lo:hi], slot)
        self.link.finish()
        self.staged.clear()

    def _grad_block(self, grads, block: tuple[int, int, int], slot: int) -> torch.Tensor:
        c, lo, hi = block
        if self.staged.staged(c):
            return self.staged.view(c, lo, hi)
        return self.link.fetch_grad(grads[c][lo:hi], slot)

    def publish(self, params_out: list[torch.Tensor]) -> None:
        """Copy the master into the device parameter partition (after loading a checkpoint)."""
        for c, master in enumerate(self.chunks["master"]):
            params_out[c].copy_(master)

    def fragment_views(self, kind: str) -> list[torch.Tensor]:
        """Per-chunk 1-D tensors of ``kind`` (master / exp_avg / exp_avg_sq) for checkpoints."""
        return self.chunks[kind]

    def resident(self) -> dict[str, list[torch.Tensor]]:
        """Host storages by memory-report category."""
        return {"master32": [self.master], "adam_moments": [self.moments],
                "buffers": self.link.buffers() + self.staged.buffers()}

    def tensors(self) -> list[torch.Tensor]:
        """Resident Adam-moment storages (both moments, one storage)."""
        return [self.moments]

    def close(self) -> None:
        """Nothing to release (interface symmetry with the NVMe backend)."""
