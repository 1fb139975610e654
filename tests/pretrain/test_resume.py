"""Resume is exact: 2N uninterrupted steps give bit-identical losses to N steps + save + load + N
steps (fp32 stage 1 with full recompute, bf16 stage 2 with selective recompute, fp16 stage 3 with
its loss scaler, bf16 stage 2 with the optimizer state offloaded to the CPU, bf16 stage 3 with the
optimizer state and the parameter partitions on NVMe), also when the stop comes from SIGTERM or
--exit-duration-in-mins. The oracle is the uninterrupted run in the same layout."""

import os
import signal

import pytest

from hybrid.checkpoint import CheckpointReader
from tests.training_helpers import make_trainer, tiny_args

FIXED_SCHEDULE = ["--lr-decay-iters", "4"]  # the schedule must not depend on where a run stops


def _losses(args, record=None):
    trainer = make_trainer(args, record)
    trainer.train()
    return trainer


@pytest.mark.parametrize("precision,stage,recompute,offload", [
    ("fp32", 1, "full", "none"), ("bf16", 2, "selective", "none"), ("fp16", 3, "none", "none"),
    ("bf16", 2, "none", "cpu"), ("bf16", 3, "none", "nvme-params")])
def test_resume_is_bit_identical(tmp_path, precision, stage, recompute, offload):
    # fp16: a too-high initial loss scale makes the first 2 steps overflow and back off, so the
    # resumed half only matches if the scaler state came back from the checkpoint
    scaler = ["--initial-loss-scale", str(2.0 ** 20), "--hysteresis", "1"] if precision == "fp16" else []
    nvme = offload == "nvme-params"   # each run its own files: the runs share this process
    placement = (["--offload-optimizer", offload] if not nvme else
                 ["--offload-optimizer", "nvme", "--offload-params", "nvme"])
    where = (lambda run: ["--offload-nvme-path", str(tmp_path / f"nvme-{run}")]) if nvme else \
        (lambda run: [])
    base = tiny_args(zero=stage, precision=precision,
                     extra=FIXED_SCHEDULE + scaler + ["--recompute", recompute] + placement)
    full_record, part_record = [], []
    full_run = _losses(base + ["--train-iters", "4"] + where("full"), full_record)
    full = full_run.losses
    first = _losses(base + ["--train-iters", "2", "--save", str(tmp_path)] + where("first"),
                    part_record)
    second = _losses(base + ["--train-iters", "4", "--load", str(tmp_path)] + where("second"),
                     part_record)
    assert first.losses + second.losses == full          # exact, not approximately
    assert second.ts.skipped_iterations == full_run.ts.skipped_iterations == (2 if scaler else 0)
    assert part_record == full_record                    # the same samples, in the same order
    reader = CheckpointReader(tmp_path)
    assert reader.metadata["train_state"]["consumed_train_samples"] == 2 * 8
    saved = reader.metadata["config"]
    expected = second.cfg.to_dict() | {"checkpoint": saved["checkpoint"],
                                       "training": saved["training"]}
    if nvme:   # each run had its own offload directory
        expected["parallel"] |= {"offload_nvme_path": saved["parallel"]["offload_nvme_path"]}
    assert saved == expected
    assert reader.metadata["config"]["optimizer"]["bf16"] == (precision == "bf16")


def test_sigterm_saves_and_resume_continues(tmp_path):
    base = tiny_args(extra=FIXED_SCHEDULE + ["--train-iters", "4"])
    full = _losses(base).losses
    record: list = []
    stopped = _losses(base + ["--save", str(tmp_path)], _Killer(at=5))   # during iteration 2
    assert stopped.ts.iteration == 2 and len(stopped.losses) == 2    # finished the step it was in
    resumed = _losses(base + ["--load", str(tmp_path)], record)
    assert stopped.losses + resumed.losses == full
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL        # handler removed again


def test_exit_duration_saves_after_first_step(tmp_path):
    trainer = _losses(tiny_args(extra=["--exit-duration-in-mins", "1e-9", "--save", str(tmp_path)]))
    assert trainer.ts.iteration == 1
    assert CheckpointReader(tmp_path).metadata["train_state"]["iteration"] == 1


def _sigterm_on_rank_1(rank, world_size, ckpt):
    record = _Killer(at=3) if rank == 1 else []     # DP 2: 2 micro-batches per iteration
    trainer = _losses(tiny_args(zero=0, extra=FIXED_SCHEDULE + ["--train-iters", "4", "--save", ckpt]),
                      record)
    return trainer.ts.iteration


class _Killer(list):
    """Records micro-batches; sends SIGTERM to its own process when the ``at``-th one is read."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def append(self, item):
        super().append(item)
        if len(self) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_on_one_rank_stops_every_rank_together(tmp_path):
    """Also: at stage 0 (state replicated over DP) only DP rank 0 writes tensors, and the run resumes
    in one process at stage 1 on the curve of an uninterrupted single-process run."""
    from safetensors import safe_open

    from hybrid.testing.multirank import run_on_ranks
    iterations = run_on_ranks(_sigterm_on_rank_1, 2, args=(str(tmp_path),), timeout=300)
    assert iterations == [2, 2]
    reader = CheckpointReader(tmp_path)
    assert reader.metadata["train_state"]["iteration"] == 2
    with safe_open(str(reader.directory / "rank_00001.safetensors"), framework="pt") as f:
        assert all(k.startswith("extra:") for k in f.keys())       # RNG states only
    base = tiny_args(extra=FIXED_SCHEDULE + ["--train-iters", "4"])
    resumed = _losses(base + ["--load", str(tmp_path)]).losses
    reference = _losses(base).losses
    assert resumed == pytest.approx(reference[2:], rel=1e-5)


def test_loading_other_model_dims_is_refused(tmp_path):
    from hybrid.checkpoint import CheckpointError
    _losses(tiny_args(iters=1, extra=["--save", str(tmp_path)]))
    with pytest.raises(CheckpointError, match="other dims .*hidden-size: checkpoint 32 vs this run 64"):
        make_trainer(tiny_args(iters=2, extra=["--load", str(tmp_path), "--hidden-size", "64"]))


def test_resume_with_dropout_restores_the_random_streams(tmp_path):
    """Dropout draws from the default and the TP-region generators: only restoring both (saved per
    rank) makes the resumed half identical."""
    base = tiny_args(extra=FIXED_SCHEDULE + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"])
    full = _losses(base + ["--train-iters", "4"]).losses
    first = _losses(base + ["--train-iters", "2", "--save", str(tmp_path)]).losses
    second = _losses(base + ["--train-iters", "4", "--load", str(tmp_path)]).losses
    assert first + second == full


def _load_corrupted_on_rank_1(rank, world_size, ckpt):
    from hybrid.checkpoint import CheckpointError
    args = tiny_args(zero=1, extra=FIXED_SCHEDULE + ["--train-iters", "4", "--load", ckpt])
    try:
        make_trainer(args)
    except CheckpointError as err:
        return str(err)
    return "loaded"


def test_a_corrupted_checkpoint_fails_every_rank(tmp_path):
    """Loading a corrupted checkpoint at DP 2 fails both ranks with the reason (the ranks agree on
    the outcome before any training collective, so none is left waiting)."""
    from hybrid.testing.multirank import run_on_ranks
    _losses(tiny_args(zero=0, extra=FIXED_SCHEDULE + ["--train-iters", "1", "--save", str(tmp_path)]))
    path = next(tmp_path.glob("iter_*")) / "rank_00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    messages = run_on_ranks(_load_corrupted_on_rank_1, 2, args=(str(tmp_path),), timeout=300)
    assert all("loading checkpoint" in m and "hash mismatch" in m or "failed on rank" in m
               for m in messages), messages
