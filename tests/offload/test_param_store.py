"""hybrid.offload.param_store without an engine: a fake ZeRO-3 step (every unit fetched for its
forward gather, again in backward, then all written by the optimizer) over fake units of uneven
sizes. Checked: bitwise round trip and the documented file layout, the read-ahead following the
fetch order (given or recorded in the first step) so steady-state fetches are cache hits, a fixed
number of resident buffers, write-back through an offload backend's ``update`` (the store's
``writer()`` as ``params_out``) equal to the backend's master rounded to bf16, memory-mapped
checkpoint views with write-through, and the misuse errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid.adamw_config import AdamWConfig
from hybrid.offload import CPUAdamW, HostOptimizerState
from hybrid.offload.param_store import NVMeParamStore

SIZES = [48, 160, 96, 160, 64]          # embedding, three layers, final norm (chunks of one rank)
FORWARD = [0, 1, 2, 3, 4]
ORDER = FORWARD + [0] + [4, 3, 2, 1]    # forward, tied output layer, backward (no embedding)


def _values(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in SIZES]


def _store(tmp_path, **kw) -> NVMeParamStore:
    store = NVMeParamStore(SIZES, dtype=torch.bfloat16, directory=str(tmp_path), rank=2, **kw)
    for k, v in enumerate(_values(0)):
        store.write(k, v)
    return store


def _pass(store, truth, order=ORDER):
    """One step's gathers: fetch, 'all-gather' (a copy), release; compared with the truth."""
    for k in order:
        shard = store.fetch(k)
        assert torch.equal(shard, truth[k]), f"unit {k} differs"
        store.release(k)


def test_round_trip_and_file_layout(tmp_path):
    store = _store(tmp_path)
    truth = _values(0)
    _pass(store, truth)
    store.flush()
    assert store.path.endswith("params_rank00002.bin")
    raw = np.fromfile(store.path, dtype=np.uint16)           # bf16 bit patterns, unit after unit
    assert raw.size == sum(SIZES)
    expect = torch.cat(truth).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(raw, expect)
    for k, view in enumerate(store.shard_views()):
        assert torch.equal(view, truth[k])
    store.close()


@pytest.mark.parametrize("given", [True, False])
def test_read_ahead_follows_the_fetch_order(tmp_path, given):
    """With the order given (or recorded during the first step), every fetch after the first
    step hits a buffer filled ahead of it, reads are issued in the order, and only 4 buffers
    exist."""
    store = _store(tmp_path, buffers=4, order=ORDER if given else None)
    truth = _values(0)
    store.invalidate()                     # nothing cached: everything comes from the file
    _pass(store, truth)
    store.end_step()
    assert store.order == ORDER
    for _ in range(2):
        store.trace.clear()
        _pass(store, truth)
        store.end_step()
        fetches = [e for e in store.trace if e[0] in ("hit", "miss")]
        assert [u for _, u in fetches] == ORDER
        assert all(kind == "hit" for kind, _ in fetches), store.trace
        assert any(kind == "read" for kind, _ in store.trace)
        # each read is of one of the next 2 (lookahead) distinct units to be fetched, this step's
        # or, at its end, the next step's
        for i, (kind, unit) in enumerate(store.trace):
            if kind == "read":
                later = [u for k, u in store.trace[i + 1:] if k in ("hit", "miss")] + ORDER
                assert unit in list(dict.fromkeys(later))[:2], f"read of {unit}: {store.trace}"
    assert len(store.resident()) == 4
    assert sum(t.nbytes for t in store.resident()) == 4 * max(SIZES) * 2
    store.close()


def test_deviating_fetches_resynchronise(tmp_path):
    """A fetch out of the order (activation recompute gathers a unit again) is served and the
    read-ahead continues from there."""
    store = _store(tmp_path, buffers=3, order=ORDER)
    truth = _values(0)
    _pass(store, truth, [0, 1, 3, 2, 3, 4, 0, 4, 3, 2, 1, 2])
    _pass(store, truth, ORDER)          # back in step: at most a few misses while resyncing
    store.trace.clear()
    _pass(store, truth, ORDER)
    assert all(kind == "hit" for kind, _ in store.trace if kind != "read"), store.trace
    store.close()


def test_write_back_after_the_optimizer(tmp_path):
    """The store's writer() as params_out of HostOptimizerState.update: every unit's new chunk is
    the backend's fp32 master rounded to bf16, in the buffers (cache) and in the file; a later
    fetch returns it; only the fixed buffers were used."""
    store = _store(tmp_path, buffers=3, order=ORDER)
    backend = HostOptimizerState(SIZES, [[(0, s)] for s in SIZES],
                                 CPUAdamW(AdamWConfig(lr=1e-2), kernel="exact", block_elems=50),
                                 device=torch.device("cpu"), param_dtype=torch.bfloat16)
    for k, v in enumerate(_values(0)):
        backend.write_master(k, 0, v.float())
    for step in range(3):
        _pass(store, [m.to(torch.bfloat16) for m in backend.fragment_views("master")])
        with store.writer() as out:
            backend.update([g.float() for g in _values(10 + step)], out, lr=1e-2)
        store.end_step()
    new = [m.to(torch.bfloat16) for m in backend.fragment_views("master")]
    assert not torch.equal(new[0], _values(0)[0])           # the optimizer did move them
    _pass(store, new)
    for k, view in enumerate(store.shard_views()):
        assert torch.equal(view, new[k])
    assert len(store.resident()) == 3
    store.close()


def test_checkpoint_views_write_through(tmp_path):
    store = _store(tmp_path)
    views = store.shard_views()
    views[3][7] = 42.0                     # a checkpoint load writes a unit through the map
    store.invalidate()
    assert store.fetch(3)[7] == 42.0
    store.release(3)
    store.close()


def test_misuse_is_refused(tmp_path):
    store = _store(tmp_path, buffers=2)
    store.fetch(0)
    store.fetch(1)
    with pytest.raises(RuntimeError, match="all 2 parameter buffers are held"):
        store.fetch(2)
    with pytest.raises(RuntimeError, match="written while fetched"):
        store.open_for_write(1)
    store.release(0)
    store.release(1)
    with pytest.raises(RuntimeError, match="not fetched"):
        store.release(1)
    writer = store.writer()
    writer[0].fill_(1.0)
    writer[1].fill_(2.0)
    with pytest.raises(RuntimeError, match="in order"):
        writer[0]
    writer.close()
    with pytest.raises(RuntimeError, match="in use by another parameter store"):
        NVMeParamStore(SIZES, dtype=torch.bfloat16, directory=store.path.rsplit("/", 1)[0], rank=2)
    store.close()
    with pytest.raises(ValueError, match="at least 2 buffers"):
        NVMeParamStore(SIZES, dtype=torch.bfloat16, directory=str(tmp_path / "x"), rank=0,
                       buffers=1)
