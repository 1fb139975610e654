"""Micro-batch loader with background prefetch, so reading the memory-mapped data never stalls the
training step (the role of Megatron-LM's DataLoader with workers and pinned memory).

A daemon thread walks the sampler, gathers each micro-batch of ``[b, s + 1]`` token samples and
queues ``tokens = x[:, :-1]`` / ``labels = x[:, 1:]`` as int64 tensors ``[b, s]`` and a float
``loss_mask [b, s]`` (ones; zero where the input is the end-of-document token if
``eod_mask_loss`` is that token, Megatron's ``--eod-mask-loss``). On CUDA the batch is pinned in
the thread and copied to the device asynchronously by the consumer. With Megatron's
``--reset-position-ids`` / ``--reset-attention-mask`` the batch also holds ``position_ids`` and
``document_ids [b, s]`` (int64; :mod:`hybrid.data.documents`). Errors in the thread are
re-raised in the consumer; the loader never blocks forever on a dead thread.

With ``vocab_size`` the thread also checks every token id against ``[0, vocab_size)`` on the host,
before the copy (issue 36): the model's own range check would read the device every forward, so the
training path leaves it to the loader and a bad id still stops the run with one clear error.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from hybrid.data.documents import document_tensors
from hybrid.data.sampler import PretrainingSampler

_END = object()


def check_token_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` (numpy on the host: no device read)."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}) (the model's vocab size); the data "
                         f"holds [{int(ids.min())}, {int(ids.max())}] - does the tokenizer that "
                         f"preprocessed it match --vocab-size / --tokenizer-model?")


def collate(samples: Sequence[np.ndarray], eod: int | None = None,
            vocab_size: int | None = None,
            documents: tuple[int | None, bool, bool] | None = None) -> dict[str, torch.Tensor]:
    """``[b, s + 1]`` samples -> the micro-batch dict; ``eod``: the token whose input position gets
    no loss; ``documents``: (EOD id, reset positions, reset attention) for the document tensors."""
    stacked = np.stack(samples).astype(np.int64)                  # [b, s + 1]
    if vocab_size is not None:
        check_token_ids(stacked, vocab_size)
    batch = torch.from_numpy(stacked)
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # [b, s] each
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod is not None:
        loss_mask[tokens == eod] = 0.0
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
    if documents is not None:
        doc_eod, reset_positions, reset_attention = documents
        batch.update(document_tensors(tokens, doc_eod, reset_positions=reset_positions,
                                      reset_attention=reset_attention))
    return batch


def _produce(dataset, sampler: Iterable[list[int]], eod: int | None, pin: bool,
             out: queue.Queue, stop: threading.Event, vocab_size: int | None = None,
             documents: tuple[int | None, bool, bool] | None = None) -> None:
    """The prefetch thread. It holds no reference to the loader, so a loader that is dropped
    without close() is garbage-collected, its __del__ sets ``stop`` and this thread ends."""
    try:
        n = len(dataset)
        for indices in sampler:
            batch = collate([dataset[i % n] for i in indices], eod, vocab_size, documents)
            if pin:
                batch = {k: v.pin_memory() for k, v in batch.items()}
            if not _put(out, stop, batch):
                return
        _put(out, stop, _END)
    except BaseException as e:  # forwarded to the consumer, which re-raises it
        _put(out, stop, e)


def _put(out: queue.Queue, stop: threading.Event, item) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class PrefetchLoader:
    """Iterate micro-batches ``{"tokens", "labels", "loss_mask"}`` (each ``[b, s]``; with
    ``reset_position_ids`` / ``reset_attention_mask`` also ``position_ids`` / ``document_ids``,
    whose documents end at the token ``eod``) of ``dataset`` in the order of ``batch_sampler``
    (lists of sample indices), ``prefetch`` micro-batches ahead.

    Indices past the end of the dataset wrap around (an unbounded sampler cycles the data).
    """

    def __init__(self, dataset, batch_sampler: Iterable[list[int]], *, prefetch: int = 4,
                 device: str | torch.device = "cpu", eod_mask_loss: int | None = None,
                 vocab_size: int | None = None, eod: int | None = None,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if len(dataset) == 0:
            raise ValueError("cannot load from an empty dataset")
        self.device = torch.device(device)
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._done = False
        documents = None
        if reset_position_ids or reset_attention_mask:
            document_tensors(torch.zeros(1, 1, dtype=torch.int64), eod, reset_positions=True,
                             reset_attention=True)   # no EOD id: the one clear error, here
            documents = (eod, reset_position_ids, reset_attention_mask)
        self._thread = threading.Thread(
            target=_produce, name="data-prefetch", daemon=True,
            args=(dataset, batch_sampler, eod_mask_loss, self.device.type == "cuda",
                  self._queue, self._stop, vocab_size, documents))
        self._thread.start()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the data prefetch thread died without a result") from None
        if item is _END or isinstance(item, BaseException):
            self._done = True
            self._stop.set()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            if isinstance(item, ValueError):   # bad data: the one clear message
                raise ValueError(str(item)) from item
            raise RuntimeError(f"loading a micro-batch failed: {item}") from item
        return {k: v.to(self.device, non_blocking=True) for k, v in item.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __del__(self) -> None:
        if hasattr(self, "_stop"):  # absent if __init__ raised
            self._stop.set()

    def __enter__(self) -> "PrefetchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_pretraining_loader(dataset, *, consumed_samples: int, micro_batch_size: int,
                             data_parallel_rank: int, data_parallel_size: int,
                             total_samples: int | None = None, device: str | torch.device = "cpu",
                             prefetch: int = 4, eod_mask_loss: int | None = None,
                             vocab_size: int | None = None, eod: int | None = None,
                             reset_position_ids: bool = False,
                             reset_attention_mask: bool = False) -> PrefetchLoader:
    """The training loader of one DP rank, resuming at the global ``consumed_samples``; with
    ``vocab_size`` it refuses out-of-range token ids on the host; ``reset_position_ids`` /
    ``reset_attention_mask`` (documents ending at ``eod``): the batches' document tensors."""
    sampler = PretrainingSampler(total_samples, consumed_samples, micro_batch_size,
                                 data_parallel_rank, data_parallel_size)
    return PrefetchLoader(dataset, sampler, prefetch=prefetch, device=device,
                          eod_mask_loss=eod_mask_loss, vocab_size=vocab_size, eod=eod,
                          reset_position_ids=reset_position_ids,
                          reset_attention_mask=reset_attention_mask)
