"""Checkpoint format without process groups: resharding arithmetic, atomic commit, manifest errors.

Several "ranks" are simulated in one process by writing their rank files into one temporary
directory, then committing it as rank 0 would. The oracle is the canonical full tensor each piece
was cut from.
"""

import json
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import CheckpointError, CheckpointReader, Piece, read_latest
from hybrid.checkpoint.format import (FORMAT_VERSION, MANIFEST_FILE, METADATA_FILE,
                                      iteration_dir_name, rank_file_name)
from hybrid.checkpoint.writer import (commit_directory, prune_checkpoints, save_checkpoint,
                                      write_rank_file)
from hybrid.parallel_state import ParallelState

VOCAB = 10


def padded(tp):          # Megatron-style vocab padding to a multiple of 4 x TP
    m = 4 * tp
    return -(-VOCAB // m) * m


def canonical():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(VOCAB, 4, generator=g)
    return {"col": (torch.randn(8, 6, generator=g), 0), "row": (torch.randn(6, 8, generator=g), 1),
            "norm": (torch.randn(6, generator=g), -1), "emb": (emb, 0)}


def full_for(name, tp):
    full, pdim = canonical()[name]
    if name == "emb":
        full = torch.cat([full, torch.zeros(padded(tp) - VOCAB, 4)])
    return full, pdim


def layout_pieces(tp, dp, kind="master"):
    """Pieces of every (tp_rank, dp_rank): the TP-local tensor flattened, cut into dp uneven ranges."""
    per_rank = {}
    for t in range(tp):
        for d in range(dp):
            per_rank[d * tp + t] = []
        for name in canonical():
            full, pdim = full_for(name, tp)
            local = (full.chunk(tp, pdim)[t] if pdim >= 0 else full).reshape(-1)
            bounds = [0] + [(local.numel() * (i + 1)) // dp + (1 if i == 0 else 0) for i in range(dp)]
            bounds[-1] = local.numel()
            for d in range(dp):
                lo, hi = bounds[d], bounds[d + 1]
                if hi > lo:
                    per_rank[d * tp + t].append(Piece(name, kind, full.shape, pdim, t, tp, lo,
                                                      local[lo:hi].clone(),
                                                      VOCAB if name == "emb" else None))
    return per_rank


def write_layout(root: Path, iteration: int, tp: int, dp: int, keep_last: int = 2) -> Path:
    final = root / iteration_dir_name(iteration)
    tmp = root / (final.name + ".tmp")
    tmp.mkdir(parents=True)
    for rank, pieces in layout_pieces(tp, dp).items():
        write_rank_file(tmp, rank, pieces, {"cpu": torch.arange(rank + 1, dtype=torch.uint8)})
    commit_directory(root, tmp, final, {"iteration": iteration, "layout": {"tp": tp, "dp": dp}},
                     keep_last)
    return final


@pytest.mark.parametrize("save_layout,load_layout", [((2, 2), (1, 3)), ((2, 3), (4, 1)),
                                                     ((1, 1), (2, 2)), ((4, 2), (1, 1)),
                                                     ((2, 2), (2, 3)), ((1, 3), (1, 2))])
def test_reshard_any_layout_to_any_other(tmp_path, save_layout, load_layout):
    write_layout(tmp_path, 5, *save_layout)
    reader = CheckpointReader(tmp_path)
    for pieces in layout_pieces(*load_layout).values():
        for expected in pieces:
            target = Piece(expected.name, "master", expected.full_shape, expected.partition_dim,
                           expected.tp_rank, expected.tp_size, expected.offset,
                           torch.full_like(expected.tensor, float("nan")), expected.valid_rows)
            reader.fill(target)
            torch.testing.assert_close(target.tensor, expected.tensor, rtol=0, atol=0)
    last = save_layout[0] * save_layout[1] - 1
    assert torch.equal(reader.extra(last)["cpu"], torch.arange(last + 1, dtype=torch.uint8))


def test_latest_marker_points_to_last_complete_and_stale_tmp_is_ignored(tmp_path):
    write_layout(tmp_path, 1, 2, 1)
    write_layout(tmp_path, 2, 2, 1)
    assert read_latest(tmp_path) == iteration_dir_name(2)
    (tmp_path / (iteration_dir_name(3) + ".tmp")).mkdir()   # a save that crashed half-way
    assert CheckpointReader(tmp_path).metadata["iteration"] == 2
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        CheckpointReader(tmp_path / (iteration_dir_name(3) + ".tmp"))


def test_keep_last_k_deletes_oldest(tmp_path):
    for it in (1, 2, 3, 4):
        write_layout(tmp_path, it, 1, 1, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [iteration_dir_name(3),
                                                               iteration_dir_name(4)]
    assert prune_checkpoints(tmp_path, 1) == [tmp_path / iteration_dir_name(3)]


def test_commit_refuses_when_rank_files_are_missing(tmp_path):
    """Rank files of other nodes that rank 0 cannot see: not a shared filesystem."""
    tmp = tmp_path / "iter_0000001.tmp"
    tmp.mkdir()
    write_rank_file(tmp, 0, layout_pieces(1, 1)[0], {})
    with pytest.raises(CheckpointError, match="sees 1 of 4 rank files .* every node shares"):
        commit_directory(tmp_path, tmp, tmp_path / "iter_0000001", {}, 2, expected_ranks=4)
    assert read_latest(tmp_path) is None


def test_single_rank_collective_save(tmp_path):
    world = ParallelState.single_process().world
    piece = Piece("w", "model", (3, 2), -1, 0, 1, 0, torch.arange(6.0))
    final = save_checkpoint(tmp_path, 7, [piece], {}, {"note": "x"}, world)
    reader = CheckpointReader(tmp_path)
    assert final.name == iteration_dir_name(7) and reader.metadata["note"] == "x"
    torch.testing.assert_close(reader.full_tensor("model", "w"), torch.arange(6.0).view(3, 2))


# ---- errors ----------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    return write_layout(tmp_path, 3, 2, 2)


def test_truncated_shard(saved):
    path = saved / rank_file_name(1)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated shard .*rank_00001"):
        CheckpointReader(saved)


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_hash_mismatch(saved):
    _corrupt(saved / rank_file_name(2))
    with pytest.raises(CheckpointError, match="hash mismatch .*rank_00002"):
        CheckpointReader(saved, verify="all")
    reader = CheckpointReader(saved)              # lazy: checked when rank 2's file is first read
    with pytest.raises(CheckpointError, match="hash mismatch .*rank_00002"):
        reader.fill(Piece("col", "master", (8, 6), 0, 0, 1, 0, torch.empty(48)))


def test_same_tp_reads_only_the_files_it_needs(saved):
    """Layout TP2 x DP2: rank r = dp * 2 + tp. A TP-rank-1 target (same TP degree) needs ranks 1 and
    3 only, so a corrupted rank 2 file does not stop it, and the values are exact."""
    _corrupt(saved / rank_file_name(2))
    reader = CheckpointReader(saved)
    full, _ = full_for("col", 2)
    target = Piece("col", "master", full.shape, 0, 1, 2, 5, torch.empty(12))
    reader.fill(target)
    torch.testing.assert_close(target.tensor, full.chunk(2, 0)[1].reshape(-1)[5:17], rtol=0, atol=0)


def test_missing_shard_file(saved):
    (saved / rank_file_name(3)).unlink()
    with pytest.raises(CheckpointError, match="missing shard .*rank_00003"):
        CheckpointReader(saved)


def test_missing_pieces_detected_even_without_manifest_entry(saved):
    (saved / rank_file_name(0)).unlink()
    manifest = json.loads((saved / MANIFEST_FILE).read_text())
    del manifest["files"][rank_file_name(0)]
    (saved / MANIFEST_FILE).write_text(json.dumps(manifest))
    reader = CheckpointReader(saved)
    target = Piece("col", "master", (8, 6), 0, 0, 1, 0, torch.empty(48))
    with pytest.raises(CheckpointError, match="missing shard: master of 'col'"):
        reader.fill(target)                                   # resharding path
    same_tp = Piece("col", "master", (8, 6), 0, 0, 2, 0, torch.empty(24))
    with pytest.raises(CheckpointError, match=r"missing shard: master of 'col' \(TP rank 0 of 2\)"):
        reader.fill(same_tp)                                  # same-TP fast path


def test_newer_format_version(saved):
    manifest = json.loads((saved / MANIFEST_FILE).read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (saved / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="newer than this code"):
        CheckpointReader(saved)


def test_other_model_dims(saved):
    reader = CheckpointReader(saved)
    with pytest.raises(CheckpointError, match="model dims differ"):
        reader.fill(Piece("row", "master", (6, 16), 1, 0, 1, 0, torch.empty(96)))
    with pytest.raises(CheckpointError, match="model dims differ"):   # rows without declared padding
        reader.fill(Piece("col", "master", (16, 6), 0, 0, 1, 0, torch.empty(96)))
    with pytest.raises(CheckpointError, match="has no master state for parameter 'extra'"):
        reader.fill(Piece("extra", "master", (2,), -1, 0, 1, 0, torch.empty(2)))


def test_no_checkpoint_here(tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        CheckpointReader(tmp_path)
    assert not (tmp_path / METADATA_FILE).exists()


def _save_with_a_failing_rank(rank, world_size, root):
    from hybrid.topology import Topology
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size))
    piece = Piece("w", "model", (4,), -1, 0, 1, 0, torch.arange(4.0))
    pieces = [piece, piece] if rank == 1 else [piece]          # rank 1: duplicate key -> error
    try:
        save_checkpoint(root, 1, pieces, {}, {}, state.world)
    except CheckpointError as err:
        return str(err)
    return "saved"


def test_a_failing_rank_fails_the_save_on_every_rank(tmp_path):
    from hybrid.testing.multirank import run_on_ranks
    messages = run_on_ranks(_save_with_a_failing_rank, 2, args=(str(tmp_path),), timeout=120)
    assert "writing the rank file failed on rank 1" in messages[0]
    assert "failed on this rank: two pieces with key" in messages[1]
    assert read_latest(tmp_path) is None                         # nothing was committed
