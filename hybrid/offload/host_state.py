"""Optimizer state in host memory: ZeRO-Offload (Ren et al. 2021, §4) for every ZeRO stage.

The fp32 master partition and both Adam moments of this rank live in host memory (12 bytes per
owned parameter, pinned when the model is on a GPU). Each optimizer step walks the partition block
by block: the block's reduced fp32 gradient comes to the host, the CPU Adam updates it in place and
writes the new values in the parameter dtype into a staging buffer that goes back to the device.

On CUDA, :class:`DeviceLink` double-buffers both directions in pinned memory on two side streams, so
the gradient copy of block i+1 and the parameter copy of block i-1 run while block i is updated. On
CPU "device" and host are the same memory: gradients are read where they are and the update writes
straight into the parameter partition (no copies) - the same interfaces, tested on CPU.

The engines (:mod:`hybrid.zero.optimizer`, :mod:`hybrid.zero.stage3`) see an optimizer-state
backend with this interface (also implemented by :class:`hybrid.offload.nvme.NVMeOptimizerState`):
``write_master(chunk, offset, values)``, ``update(grads, params_out, lr=)``, ``publish(params_out)``,
``fragment_views(kind)``, ``resident()``, ``step``. A partition is a list of flat chunks (one per
bucket or unit); ``decay_ranges[c]`` lists the (offset, numel) pieces of chunk c with weight decay.
"""

from __future__ import annotations

import torch

from hybrid.offload.cpu_adam import CPUAdamW

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


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

    def out_buffer(self, param_block: torch.Tensor, slot: int) -> torch.Tensor:
        """Host memory the updated block is written into (the parameter itself on CPU)."""
        if not self.cuda:
            return param_block
        self.out_free[slot].synchronize()      # the previous copy from this slot has finished
        return self.out_slots[slot][:param_block.numel()]

    def push(self, host_block: torch.Tensor, param_block: torch.Tensor, slot: int) -> None:
        """Send the updated host block to the device parameter partition (async on CUDA)."""
        if not self.cuda:
            if host_block.data_ptr() != param_block.data_ptr():
                param_block.copy_(host_block)
            return
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


def ranges_in(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of (offset, numel) ``ranges`` inside [lo, hi), relative to lo."""
    out = []
    for start, numel in ranges:
        a, b = max(start, lo), min(start + numel, hi)
        if a < b:
            out.append((a - lo, b - a))
    return out


class HostOptimizerState:
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
        self.step = 0

    def write_master(self, chunk: int, offset: int, values: torch.Tensor) -> None:
        """Initial (or loaded) master values for elements [offset, +numel) of ``chunk``."""
        self.chunks["master"][chunk][offset:offset + values.numel()].copy_(values.reshape(-1))

    def update(self, grads: list[torch.Tensor], params_out: list[torch.Tensor], *, lr: float) -> None:
        """AdamW on the whole partition from fp32 ``grads`` (per chunk, on the device, already
        unscaled and clipped); updated values are written into ``params_out`` (per chunk)."""
        self.step += 1
        blocks = blocks_of(self.sizes, self.adam.block_elems)
        pending = self.link.fetch_grad(grads[blocks[0][0]][blocks[0][1]:blocks[0][2]], 0) \
            if blocks else None
        for i, (c, lo, hi) in enumerate(blocks):
            host_grad, slot = pending, i % 2
            if i + 1 < len(blocks):   # next block's gradient moves while this one is updated
                c2, lo2, hi2 = blocks[i + 1]
                pending = self.link.fetch_grad(grads[c2][lo2:hi2], (i + 1) % 2)
            self.link.wait_grad(slot)
            out = self.link.out_buffer(params_out[c][lo:hi], slot)
            state = [self.chunks[k][c][lo:hi] for k in STATE_KINDS]
            self.adam.step_(state[0], host_grad, state[1], state[2],
                            ranges_in(self.decay_ranges[c], lo, hi), step=self.step, lr=lr, out=out)
            self.link.push(out, params_out[c][lo:hi], slot)
        self.link.finish()

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
                "buffers": self.link.buffers()}

    def tensors(self) -> list[torch.Tensor]:
        """Resident Adam-moment storages (as FlatAdamWState.tensors, for the memory report)."""
        return [self.moments]

    def close(self) -> None:
        """Nothing to release (interface symmetry with the NVMe backend)."""
