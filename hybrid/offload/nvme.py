"""Optimizer state on NVMe: ZeRO-Infinity's offload engine (Rajbhandari et al. 2021, §5.1-5.2).

The fp32 master and both Adam moments of this rank's partition live in one file; host memory holds
only two fixed-size block buffers. The step streams the file through them: while the CPU Adam
updates block i in buffer i%2, one I/O thread (os.pwrite / os.preadv release the GIL) writes block
i-1 back and reads block i+1 ahead - one FIFO thread, so the read into a buffer always follows the
write-back out of it. Resident host memory: 2 x 4 x 4 x ``block_elems`` bytes (master, moments and
a gradient block per buffer; plus, on CUDA, the pinned transfer slots of
:class:`~hybrid.offload.host_state.DeviceLink`), whatever the model size.

Gradients stream out as backward finalises them (ZeRO-Infinity §5): ``accept_grad(chunk, grad)``
converts the chunk to fp32 block by block through the two buffers' gradient blocks and queues its
write into a second file on the same I/O thread, so backward goes on while it is written; the step
then reads each block's gradient with its state (same FIFO thread: after its write). Chunks not
staged are read from the ``grads`` given to ``update`` as before.

File layout (little-endian fp32, no header; N = sum of the partition's chunk sizes, chunk c starts
at element ``starts[c]``)::

    offload_rank{R:05d}.bin   [ master: N x 4 B | exp_avg: N x 4 B | exp_avg_sq: N x 4 B ]
                              size 12 N bytes; element e of region k at byte (k N + e) x 4
    offload_grads_rank{R:05d}.bin  [ grad: N x 4 B ]  (only once accept_grad is used; scratch,
                              rewritten every step, not part of a checkpoint)

The file is checkpoint-compatible: :meth:`NVMeOptimizerState.fragment_views` returns memory-mapped
views of it, so a checkpoint writer copies fragments out page by page (and a loader writes them in)
without the whole state ever being resident. Writes go through the page cache, which the kernel can
evict: it is not part of the process's resident set.
"""

from __future__ import annotations

import fcntl
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from hybrid.offload.backend import STATE_KINDS, OptimizerStateBackend
from hybrid.offload.cpu_adam import CPUAdamW
from hybrid.offload.host_state import DeviceLink, blocks_of, check_grads_available, ranges_in

log = logging.getLogger(__name__)
ITEM = 4   # fp32 bytes


def open_exclusive(path: str, nbytes: int, holder_hint: str) -> int:
    """Open ``path`` read-write (mode 0600), lock it for this process alone and size it to
    ``nbytes`` of zeros (sparse until written). One owner per file: a second one would silently
    overwrite the first's data, so it gets an error naming ``holder_hint`` instead."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"{path} is in use by {holder_hint}") from None
    os.ftruncate(fd, 0)
    os.ftruncate(fd, nbytes)
    return fd


class NVMeOptimizerState(OptimizerStateBackend):
    """fp32 master + Adam moments of a partition (chunk ``sizes``) in a file under ``directory``
    (an :class:`~hybrid.offload.backend.OptimizerStateBackend`)."""

    def __init__(self, sizes: list[int], decay_ranges: list[list[tuple[int, int]]], adam: CPUAdamW,
                 *, device: torch.device, param_dtype: torch.dtype, directory: str, rank: int):
        if len(decay_ranges) != len(sizes):
            raise ValueError("decay_ranges needs one list of (offset, numel) per chunk")
        os.makedirs(directory, exist_ok=True)
        self.sizes, self.decay_ranges, self.adam = list(sizes), decay_ranges, adam
        self.starts = np.cumsum([0] + self.sizes[:-1]).tolist() if sizes else []
        self.numel = sum(sizes)
        self.path = os.path.join(directory, f"offload_rank{rank:05d}.bin")
        self.fd = open_exclusive(self.path, 3 * self.numel * ITEM,
                                 "another NVMe-offloaded optimizer; give each one its own "
                                 "--offload-nvme-path")
        n = adam.block_elems
        # on CUDA accept_grad copies into "grad" on a side stream: pinned, or the copy blocks the host
        pin = torch.device(device).type == "cuda"
        self.slots = [{k: torch.zeros(n, dtype=torch.float32, pin_memory=pin and k == "grad")
                       for k in (*STATE_KINDS, "grad")} for _ in range(2)]
        self.link = DeviceLink(device, n, param_dtype)
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-offload")
        self.grad_path = os.path.join(directory, f"offload_grads_rank{rank:05d}.bin")
        self.grad_fd = -1
        self.staged: set[int] = set()
        self._grad_writes: list[Future | None] = [None, None]   # last write out of each buffer
        self._grad_turn = 0
        self.step = 0
        log.info("NVMe optimizer state: %s (%.1f MiB), 2 buffers of %d elements", self.path,
                 3 * self.numel * ITEM / 2**20, n)

    # ---- file I/O ---------------------------------------------------------------------------
    def _byte_offset(self, kind: int, chunk: int, lo: int) -> int:
        return (kind * self.numel + self.starts[chunk] + lo) * ITEM

    def _read(self, slot: int, chunk: int, lo: int, hi: int) -> None:
        for k, kind in enumerate(STATE_KINDS):
            view = memoryview(self.slots[slot][kind][:hi - lo].numpy()).cast("B")
            got = os.preadv(self.fd, [view], self._byte_offset(k, chunk, lo))
            if got != len(view):
                raise IOError(f"short read of {self.path}: {got} of {len(view)} bytes")
        if chunk in self.staged:
            view = memoryview(self.slots[slot]["grad"][:hi - lo].numpy()).cast("B")
            got = os.preadv(self.grad_fd, [view], (self.starts[chunk] + lo) * ITEM)
            if got != len(view):
                raise IOError(f"short read of {self.grad_path}: {got} of {len(view)} bytes")

    def _write(self, slot: int, chunk: int, lo: int, hi: int) -> None:
        for k, kind in enumerate(STATE_KINDS):
            data = memoryview(self.slots[slot][kind][:hi - lo].numpy()).cast("B")
            self._pwrite(self.fd, data, self._byte_offset(k, chunk, lo))

    @staticmethod
    def _pwrite(fd: int, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)

    def write_master(self, chunk: int, offset: int, values: torch.Tensor) -> None:
        """Initial (or loaded) master values for elements [offset, +numel) of ``chunk``."""
        data = values.detach().reshape(-1).to("cpu", torch.float32).contiguous().numpy()   # CUDA too
        os.pwrite(self.fd, data.tobytes(), self._byte_offset(0, chunk, offset))

    # ---- gradients streamed out during backward ----------------------------------------------
    def accept_grad(self, chunk: int, grad: torch.Tensor) -> None:
        """Queue ``chunk``'s final reduced gradient (to be divided by the next update's
        ``grad_scale``) for the gradient file; returns once it is converted into the buffers."""
        if grad.numel() != self.sizes[chunk]:
            raise ValueError(f"gradient of chunk {chunk} has {grad.numel()} elements, the "
                             f"partition's chunk has {self.sizes[chunk]}")
        if self.grad_fd < 0:
            self.grad_fd = os.open(self.grad_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(self.grad_fd, self.numel * ITEM)
        flat = grad.detach().reshape(-1)
        for lo in range(0, flat.numel(), self.adam.block_elems):
            hi = min(flat.numel(), lo + self.adam.block_elems)
            slot, self._grad_turn = self._grad_turn, 1 - self._grad_turn
            if self._grad_writes[slot] is not None:
                self._grad_writes[slot].result()       # the buffer's previous block is written
            buf = self.slots[slot]["grad"][:hi - lo]
            done = self.link.copy_to_host(buf, flat[lo:hi])
            self._grad_writes[slot] = self.io.submit(self._write_grad, buf, done,
                                                     (self.starts[chunk] + lo) * ITEM)
        self.staged.add(chunk)

    def _write_grad(self, buf: torch.Tensor, done, offset: int) -> None:
        if done is not None:
            done.synchronize()
        self._pwrite(self.grad_fd, memoryview(buf.numpy()).cast("B"), offset)

    def drop_staged_grads(self) -> None:
        """Forget the staged gradients (the step is skipped)."""
        self._land_grad_writes()
        self.staged.clear()

    def _land_grad_writes(self) -> None:
        for i, w in enumerate(self._grad_writes):
            if w is not None:
                w.result()
                self._grad_writes[i] = None

    # ---- the step ---------------------------------------------------------------------------
    def update(self, grads: list[torch.Tensor] | None, params_out: list[torch.Tensor], *,
               lr: float, grad_scale: float = 1.0, skip: torch.Tensor | None = None) -> None:
        """AdamW over the file, block by block (see module docstring); every gradient (staged in
        the gradient file, else ``grads[c]``) is divided by ``grad_scale`` first; updated values
        go to ``params_out`` (per chunk, the partition in the parameter dtype)."""
        if skip is not None and bool(skip):   # a host step: the flag is read here
            return
        check_grads_available(grads, self.sizes, self.staged.__contains__)
        self.step += 1
        self._land_grad_writes()   # surface a failed write here; the reads follow them anyway
        self._stream(lambda i, blk, state: self._update_block(grads, params_out, blk, state, lr,
                                                              grad_scale), write_back=True)
        self.staged.clear()

    def _update_block(self, grads, params_out, blk, state, lr, grad_scale) -> None:
        c, lo, hi = blk
        if c in self.staged:
            host_grad = state["grad"]
        else:
            host_grad = self.link.fetch_grad(grads[c][lo:hi], 0)
            self.link.wait_grad(0)
        out = self.link.out_buffer(params_out[c][lo:hi], 0)
        self.adam.step_(state["master"], host_grad, state["exp_avg"], state["exp_avg_sq"],
                        ranges_in(self.decay_ranges[c], lo, hi), step=self.step, lr=lr, out=out,
                        grad_scale=grad_scale)
        self.link.push(out, params_out[c][lo:hi], 0)

    def publish(self, params_out: list[torch.Tensor]) -> None:
        """Copy the master into the device parameter partition (after loading a checkpoint)."""
        def copy(i, blk, state):
            c, lo, hi = blk
            params_out[c][lo:hi].copy_(state["master"])
        self._stream(copy, write_back=False)

    def _stream(self, body, *, write_back: bool) -> None:
        """Run ``body(i, block, state views)`` over every block with read-ahead and write-back."""
        blocks = blocks_of(self.sizes, self.adam.block_elems)
        reads: dict[int, Future] = {}
        writes: list[Future] = []
        for i in range(min(2, len(blocks))):
            reads[i] = self.io.submit(self._read, i, *blocks[i])
        for i, blk in enumerate(blocks):
            slot = i % 2
            reads.pop(i).result()
            n = blk[2] - blk[1]
            body(i, blk, {k: t[:n] for k, t in self.slots[slot].items()})
            if write_back:
                writes.append(self.io.submit(self._write, slot, *blk))
            if i + 2 < len(blocks):   # same FIFO thread: runs after this slot's write-back
                reads[i + 2] = self.io.submit(self._read, slot, *blocks[i + 2])
        for w in writes:
            w.result()
        self.link.finish()

    # ---- checkpoints and reports ------------------------------------------------------------
    def fragment_views(self, kind: str) -> list[torch.Tensor]:
        """Per-chunk 1-D tensors of ``kind`` mapped from the file (paged in on access)."""
        k = STATE_KINDS.index(kind)
        region = np.memmap(self.path, dtype=np.float32, mode="r+", offset=k * self.numel * ITEM,
                           shape=(self.numel,)) if self.numel else np.zeros(0, np.float32)
        flat = torch.from_numpy(region)
        return list(torch.split(flat, self.sizes)) if self.sizes else []

    def resident(self) -> dict[str, list[torch.Tensor]]:
        """Host storages by memory-report category: only the block buffers are resident."""
        return {"master32": [], "adam_moments": [],
                "buffers": [t for s in self.slots for t in s.values()] + self.link.buffers()}

    def tensors(self) -> list[torch.Tensor]:
        """Resident Adam-moment storages: none (they stay in the file)."""
        return []

    def close(self) -> None:
        self.io.shutdown(wait=True)
        for name in ("fd", "grad_fd"):
            if getattr(self, name, -1) >= 0:
                os.close(getattr(self, name))
                setattr(self, name, -1)

    def __del__(self):
        try:
            self.close()
        except Exception:   # interpreter shutdown: the OS closes the descriptor anyway
            pass
