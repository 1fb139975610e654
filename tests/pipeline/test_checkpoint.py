"""Checkpoints reshard across pipeline degrees (docs/design.md §8): a run saved at PP 2 (ZeRO 1)
after 2 steps is loaded at PP 4 and at PP 1; steps 3 and 4 (the next-step loss with the loaded
weights, then one more step with the loaded Adam moments and step count) match the single-device
oracle trained uninterrupted, rtol 1e-5. Parameter names are the whole model's at every degree
(layers by global index), and the last stage's copy of the tied embedding is not saved: it is
re-sent from the first stage after a load."""

from __future__ import annotations

import torch

from hybrid.checkpoint.state import load_state, save_state
from hybrid.parallel_state import ParallelState
from hybrid.pipeline import PipelineConfig, PipelineRunner, StageChunks
from hybrid.testing.multirank import run_on_ranks
from hybrid.topology import Topology
from hybrid.zero import ZeroConfig, build_zero_optimizer
from models.gpt.model import GPTModel
from tests.pipeline.test_pipeline import PipeTask, _stage_chunks, _tied
from tests.zero.test_stages import reference_run

MICRO_BATCHES = 2


def _run(rank, world_size, pp, save_dir=None, load_dir=None):
    task = PipeTask()
    data = task.data()
    state = ParallelState.initialize(Topology(world_size, 1, gpus_per_node=world_size,
                                              pipeline_parallel_size=pp))
    zero = ZeroConfig(stage=1, bucket_size=300, gradient_accumulation_steps=MICRO_BATCHES)
    runner = tied = None
    if pp == 1:
        model = GPTModel(task.config, state, device="meta")
        model.init_weights(11)
    else:
        config = PipelineConfig(pp, MICRO_BATCHES, task.config.num_layers, "1f1b")
        chunks = _stage_chunks(task, state, config, False, None)
        model, tied = StageChunks(chunks), _tied(state, chunks)
    engine = build_zero_optimizer(model, state, zero, task.adamw)
    if pp > 1:
        runner = PipelineRunner(state, config, chunks, activation_shape=(8, 4, 32), engine=engine,
                                tied=tied)
    layout = model.checkpoint_layout()
    steps = range(2)
    if load_dir is not None:
        load_state(load_dir, engine, layout, state)
        if tied is not None:
            tied.sync_weight()
        steps = range(2, 4)
    losses = []
    for step in steps:
        tokens, labels = data[step]
        mbs = [(tokens[i * 4:(i + 1) * 4], labels[i * 4:(i + 1) * 4]) for i in range(MICRO_BATCHES)]
        engine.zero_grad()
        if runner is not None:
            loss = runner.step(mbs).loss
        else:
            loss = 0.0
            for t, lab in mbs:
                micro = model(t, lab).mean() / MICRO_BATCHES
                engine.backward(micro)
                loss += float(micro)
        engine.step()
        if tied is not None:
            tied.sync_weight()
        if loss is not None:
            losses.append(loss)
    if save_dir is not None:
        save_state(save_dir, 2, engine, layout, state, extra={}, metadata={}, keep_last=2)
    return losses


def test_save_at_pp2_load_at_pp4_and_pp1(tmp_path):
    task = PipeTask()
    ref_losses = reference_run(task, task.data())[0]
    saved = run_on_ranks(_run, 2, args=(2, str(tmp_path)), timeout=300)
    torch.testing.assert_close(torch.tensor(saved[-1]), torch.tensor(ref_losses[:2]), rtol=1e-5,
                               atol=1e-6)
    checkpoint = str(tmp_path / "iter_0000002")
    for world, pp in ((4, 4), (1, 1)):
        resumed = run_on_ranks(_run, world, args=(pp, None, checkpoint), timeout=300)
        torch.testing.assert_close(torch.tensor(resumed[-1]), torch.tensor(ref_losses[2:4]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"PP {pp}: {m}")
