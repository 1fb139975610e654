"""The GPT pretraining loop (Megatron-LM's ``pretrain``), written to read like pseudocode.

    while iteration < train_iters:
        lr = schedule(iteration)
        for each of the accumulation steps:  optimizer.backward(mean loss of a micro-batch / steps)
        optimizer.step(lr)                                      # ZeRO-DP reduce, clip, AdamW
        every log_interval:   console line + TensorBoard scalars
        every eval_interval:  validation loss and perplexity               (off the clock)
        every save_interval:  layout-independent checkpoint                (off the clock)
        on SIGTERM / --exit-duration-in-mins / --exit-interval:  save and stop (all ranks agree)
    at the end (train_iters not a multiple of eval_interval):  validation  (as Megatron-LM)

Global batch = micro batch x DP x accumulation steps; each DP rank reads its slice of every micro-step
from a sampler driven by the consumed-samples count, which the checkpoint stores, so a resumed run
continues at exactly the next sample. With a batch ramp (hybrid/batch_schedule.py) each step's
global batch comes from that count too, and so does the learning rate (in steps of the final batch).

With pipeline parallelism (:mod:`pretrain.pipeline_stage`) the accumulation steps are the
pipeline's m micro-batches: a step is one run of the schedule over them, the loss comes from the last
stage (shared with every rank by the step's agreement all-reduce), evaluation runs the forward-only
schedule, and each log line adds the measured bubble and the PP bytes per step.

Nothing in a training step waits on the host (issue 36): the micro-batch losses are summed on the
device, the step's agreement (DP-mean loss, any non-finite loss) is a device all-reduce, a
non-finite loss or gradient skips the step inside the engine (bf16/fp32 ``--on-nonfinite``; fp16
through the loss scaler), and the loss, norm, skip flag and loss scale of each iteration wait on
the device until the log interval (and before a save, an evaluation and the end), where ONE read
settles them all (:meth:`Trainer._settle`). ``--on-nonfinite stop`` keeps its promise without a
read per step: once a step is non-finite, every later step is skipped on the device too (a sticky
flag), and the settle raises with the first bad iteration's number.

Evaluation and checkpoint saves run off the training clock: their seconds are their own scalars
(``eval-time``, ``checkpoint-save-time``), not part of ``iteration-time`` and the tokens/s, TFLOP/s
and MFU derived from it, and their collectives are not in the per-step bytes of the comm ledger.
So does ``--compile``'s compilation in the first steps (``compile-time``, the total so far).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from hybrid import comm
from hybrid.layout import RunLayout
from hybrid.parallel_state import ParallelState
from hybrid.perf.links import describe_collectives
from pretrain import resume
from pretrain.resume import TrainState
from pretrain.exit import ExitCondition
from hybrid.checkpoint.async_save import AsyncCheckpointWriter
from pretrain.metrics import (MetricsWriter, ThroughputModel, console_line, memory_bytes,
                             moe_metrics)
from pretrain.token_split import model_loss, split_micro_batch
from hybrid.zero.results import StepResult

log = logging.getLogger(__name__)


@dataclass
class IntervalStats:
    """Sums over the iterations since the last console line."""

    iterations: int = 0
    loss_sum: float = 0.0
    skipped: int = 0
    start: float = field(default_factory=time.perf_counter)
    off_clock: float = 0.0        # seconds of evaluation and checkpointing inside the interval
    last_grad_norm: float = float("nan")
    last_loss_scale: float = 1.0
    ledger_mark: int = 0
    bubble_sum: float = 0.0       # pipeline: measured bubble fractions of the iterations
    samples: int = 0              # trained (a batch ramp changes the global batch per step)


@dataclass
class _Pending:
    """One iteration's values, still on the device until the next settle."""

    iteration: int
    values: torch.Tensor          # float64 [mean loss, this rank's loss, loss non-finite, skipped,
                                  #          grad norm, loss scale, bubble]


class Trainer:
    def __init__(self, cfg, layout: RunLayout, state: ParallelState, model, optimizer, *, schedule,
                 make_loader, metrics: MetricsWriter, throughput: ThroughputModel, rng=None,
                 train_state: TrainState | None = None, pipeline=None, compile_clock=None):
        """``layout``: the run's micro-batches per step and global batch;
        ``make_loader(split, consumed_samples)`` -> iterator of micro-batches of this DP rank;
        ``pipeline``: this rank's :class:`~pretrain.pipeline_stage.PipelineStage` (PP > 1);
        ``compile_clock``: the :class:`~models.gpt.compile.CompileClock` of a --compile run."""
        self.cfg, self.layout, self.state = cfg, layout, state
        self.model, self.optimizer = model, optimizer
        self.schedule, self.make_loader, self.metrics = schedule, make_loader, metrics
        self.throughput, self.rng, self.pipeline = throughput, rng, pipeline
        self._step_bubble = 0.0
        self._links_logged = False   # the first interval's bytes per group and op, logged once
        self.ts = train_state or TrainState()
        self.train_iters = cfg.train_iterations(layout)
        self.ramp = cfg.batch_schedule()   # a batch ramp, or None: every step is ``layout``
        self.step_layout = layout          # this step's micro-batches and global batch
        self.last_lr = float("nan")
        self.ts.lr_schedule = schedule.record(layout.global_batch)   # stored with every checkpoint
        self._guard_nonfinite = cfg.optimizer.precision != "fp16"   # fp16: the scaler skips
        self.last_saved_iteration: int | None = None
        self.losses: list[float] = []     # DP-mean training loss of every iteration (tests, plots)
        self.compile_clock, self._compile_seen = compile_clock, 0.0
        c = cfg.checkpoint   # --async-save: the writer whose host buffers every save reuses
        self.async_save = (AsyncCheckpointWriter(state.world, state.device)
                           if c.async_save and c.save else None)
        self.memory_snapshot = None   # --memory-snapshot-step (armed in train())
        self.restarts = None          # --max-restarts: pretrain.restarts.RestartRecord (set-up sets it)
        self.stragglers = None   # --log-straggler: pretrain.stragglers.StragglerReport
        if cfg.logging.log_straggler:
            from pretrain.stragglers import StragglerReport
            self.stragglers = StragglerReport(state, cfg.logging.straggler_threshold,
                                              cfg.logging.straggler_minmax_count)
        self._pending: list[_Pending] = []   # iterations since the last settle (device values)
        self._halted: torch.Tensor | None = None   # --on-nonfinite stop: a step was non-finite
        self._step_skip: torch.Tensor | None = None   # this step's extra skip flag (device)


    # ---- the loop ----------------------------------------------------------------------------
    def train(self) -> TrainState:
        first_iteration = self.ts.iteration
        loader = self.make_loader("train", self.ts.consumed_train_samples)
        if self.stragglers is not None:
            loader = self.stragglers.timed_loader(loader)   # data wait
        self.metrics.log(self._model_state_bytes(), self.ts.iteration)
        stats = self._new_interval()
        self._arm_memory_snapshot()
        with ExitCondition(self.state.world, self.cfg.training.exit_duration_in_mins,
                           device=self.state.device) as stop:
            while self.ts.iteration < self.train_iters:
                self._follow_batch_ramp()
                if self.stragglers is None:
                    self.train_step(loader, self._learning_rate())
                else:
                    self.stragglers.timed_step(self.train_step, loader, self._learning_rate())
                self._account_compile(stats, on_clock=True)
                self._advance(stats)
                if self.async_save is not None and self.async_save.in_flight:
                    self._poll_async_save(stats)
                if self.memory_snapshot is not None and self.memory_snapshot.due(self.ts.iteration):
                    self.memory_snapshot.write(self.ts.iteration, self.optimizer)
                if self.restarts is not None:
                    self.restarts.progress(self.ts.iteration)
                if self._due(self.cfg.logging.log_interval):
                    self._settle(stats)
                    self._log_interval(stats)
                    stats = self._new_interval()
                if self._due(self.cfg.training.eval_interval) and self.cfg.training.eval_iters:
                    self._settle(stats)
                    self._off_clock(stats, "eval-time", self.evaluate)
                    self._account_compile(stats, on_clock=False)
                if self.cfg.checkpoint.save_interval and self._due(self.cfg.checkpoint.save_interval):
                    self._checkpoint(stats)
                if stop.should_exit() or self._exit_interval_reached():
                    if self.last_saved_iteration != self.ts.iteration:
                        self._checkpoint(stats)
                    break
        _close(loader)
        self._settle(stats)
        self._land_tied_weight()
        finished = self.ts.iteration >= self.train_iters > first_iteration and stop.reason is None
        if finished and not self._due(self.cfg.training.eval_interval) and self.cfg.training.eval_iters:
            self._off_clock(stats, "eval-time", self.evaluate)   # the final model's validation
        if self.ts.iteration >= self.train_iters and self.last_saved_iteration != self.ts.iteration:
            self._checkpoint(stats)
        self._finish_async_save()   # also after SIGTERM / Ctrl-C / --exit-duration-in-mins: exit 0 saved
        if self.memory_snapshot is not None:
            self.memory_snapshot.stop()
        if self.restarts is not None:
            self.restarts.report(self.ts.iteration)
        self.metrics.flush()
        return self.ts

    def train_step(self, loader, lr: float):
        """One optimizer step over the layout's m micro-batches; returns (DP-mean loss, StepResult),
        both left on the device (0-dim tensors inside; nothing here reads them)."""
        self.model.train()
        self.optimizer.zero_grad()
        if self.pipeline is not None:
            total = self._pipeline_losses(loader)
        else:
            total, m = None, self.step_layout.micro_batches
            for _ in range(m):
                loss = self._micro_batch_loss(next(loader))
                self.optimizer.backward(loss / m)
                share = loss.detach().to(torch.float64) / m   # summed on the device, no read
                total = share if total is None else total + share
        mean_loss, any_nonfinite = self._step_agreement(total)
        skip = None
        if self._guard_nonfinite:   # bf16/fp32: a non-finite loss skips the update on the device
            skip = any_nonfinite if self._halted is None else any_nonfinite | self._halted
        self._step_skip = skip   # read by _optimizer_step (whose one-argument form tests wrap)
        result = self._optimizer_step(lr)
        if self._guard_nonfinite and self.cfg.optimizer.on_nonfinite == "stop":
            # sticky: every later step is skipped too until the settle raises (weights intact)
            self._halted = result._skipped if self._halted is None else self._halted | result._skipped
        values = torch.cat([torch.stack([mean_loss, total.reshape(()).to(torch.float64),
                                         any_nonfinite.to(torch.float64)]),
                            result.device_values(self.state.device),
                            self._step_bubble.reshape(1).to(torch.float64)
                            if isinstance(self._step_bubble, torch.Tensor)
                            else torch.zeros(1, dtype=torch.float64, device=self.state.device)])
        self._pending.append(_Pending(self.ts.iteration + 1, values))
        return mean_loss, result

    def _pipeline_losses(self, loader) -> torch.Tensor:
        """One run of the pipeline schedule over the step's m micro-batches: this rank's mean loss
        (0 off the last stage), a 0-dim device tensor; measures the step's bubble (on the device)."""
        from pretrain.pipeline_stage import micro_batches, pipeline_bubble
        m = self.step_layout.micro_batches
        output = self.pipeline.runner.step(micro_batches(loader, m, self.state.device, self.state,
                                                         self.cfg.parallel.cp_comm_type))
        self._step_bubble = pipeline_bubble(self.pipeline, output, self.state)
        if output.loss_tensor is None:
            return torch.zeros((), dtype=torch.float64, device=self.state.device)
        return output.loss_tensor.detach().to(torch.float64).reshape(())

    def _learning_rate(self) -> float:
        """The schedule where this step stands: its iteration, or with a batch ramp the samples
        consumed in steps of the nominal global batch (Megatron steps its scheduler by samples)."""
        position = (self.ts.iteration if self.ramp is None
                    else self.ramp.position(self.ts.consumed_train_samples))
        self.last_lr = self.schedule(position)
        return self.last_lr

    def _follow_batch_ramp(self) -> None:
        """With a batch ramp, this step's global batch from the samples consumed: the micro-batches
        per step of the loop, the ZeRO engine's backward count and the pipeline's schedule."""
        if self.ramp is None:
            return
        batch = self.ramp.batch_at(self.ts.consumed_train_samples)
        if batch == self.step_layout.global_batch and self.ts.iteration:
            return
        layout = self.layout
        step = dataclasses.replace(layout, micro_batches=batch // (layout.micro_batch_size
                                                                   * layout.data_parallel))
        self.optimizer.set_gradient_accumulation_steps(step.backwards_per_step)
        if self.pipeline is not None:
            self.pipeline.runner.set_micro_batches(step.micro_batches)
        if step.global_batch != self.step_layout.global_batch:
            log.info("iteration %d: global batch %d (%d micro-batches per DP rank), batch ramp",
                     self.ts.iteration + 1, step.global_batch, step.micro_batches)
        self.step_layout = step

    def _step_agreement(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:

        """One world all-reduce per step (bookkeeping, kept out of the comm ledger): the DP-mean
        loss (TP ranks hold the same loss, so the world sum over world size is the DP mean; with
        PP only the last stage's dp x tp ranks add theirs; with CP each rank holds its tokens'
        share, so the CP ranks together add one loss) and whether any rank saw a non-finite
        loss, so every rank takes the same branch. Both stay on the device (0-dim float64 and
        bool): built with torch.where, never read here."""
        adds = self.pipeline is None or self.state.is_last_stage
        loss = loss.to(device=self.state.device, dtype=torch.float64).reshape(())
        nonfinite = ~torch.isfinite(loss)
        kept = torch.where(nonfinite, torch.zeros_like(loss), loss) if adds else torch.zeros_like(loss)
        t = torch.stack([kept, nonfinite.to(torch.float64)])
        world = self.state.world
        with comm.unrecorded(world):
            comm.all_reduce(t, world)
        return t[0] / (world.size // (self.state.pp_size * self.state.cp_size)), t[1] > 0

    def _settle(self, stats: IntervalStats) -> None:
        """Read the iterations' device values since the last settle (ONE device-to-host copy) and
        do their bookkeeping: losses, skipped steps, the last grad norm and loss scale, the bubble;
        the fp16 scaler's overflow log and floor error; for bf16/fp32 the non-finite warnings, or
        with ``--on-nonfinite stop`` the error of the first non-finite iteration."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        rows = torch.stack([p.values for p in pending]).tolist()
        scaler = getattr(self.optimizer, "scaler", None)
        if scaler is not None:
            scaler.check()   # fp16: the overflow log, the floor error
        for p, (mean, local, loss_bad, skipped, norm, scale, bubble) in zip(pending, rows):
            loss = float("nan") if (loss_bad and self._guard_nonfinite) else mean
            self.losses.append(loss)
            stats.bubble_sum += bubble
            stats.last_loss_scale = scale
            if skipped:
                stats.skipped += 1
                self.ts.skipped_iterations += 1
                if self._guard_nonfinite:
                    what = (f"non-finite loss (this rank: {local})" if loss_bad else
                            f"non-finite gradient (global norm {norm})")
                    self._on_nonfinite(what, p.iteration)
            else:
                stats.loss_sum += loss
                stats.last_grad_norm = norm

    def _on_nonfinite(self, what: str, iteration: int) -> None:
        """bf16/fp32 NaN/Inf, its update skipped: --on-nonfinite stop raises on every rank (they all
        see the same agreed flag), skip logs and lets the step count as skipped."""
        where = f"{what} at iteration {iteration}"
        if self.cfg.optimizer.on_nonfinite == "stop":
            raise FloatingPointError(f"{where}; stopping (--on-nonfinite stop) before the update, the "
                                     f"weights and checkpoints are intact; lower --lr or resume with "
                                     f"--on-nonfinite skip")
        log.warning("%s: step skipped (--on-nonfinite skip)", where)

    def _micro_batch_loss(self, batch: dict) -> torch.Tensor:
        """Mean per-token loss of a micro-batch over the tokens the loss mask keeps (the loader
        delivers the batch on the device, pinned and copied without a wait). Under context
        parallelism this rank's share of it: its tokens' loss over the whole samples' kept tokens
        (pretrain.token_split), which the CP ranks' shares add up to."""
        mb = split_micro_batch(batch, self.state, self.cfg.parallel.cp_comm_type)
        return model_loss(self.model, mb)

    def _optimizer_step(self, lr: float):
        """The engine's step at ``lr``, with the step's agreed non-finite flag (bf16/fp32) as an
        extra skip condition decided on the device."""
        self.optimizer.lr = lr
        skip = self._step_skip
        result = self.optimizer.step(skip) if skip is not None else self.optimizer.step()
        for module in self._moe_modules():   # DeepSeek-V3's expert bias: once per optimizer step
            module.update_expert_biases(self.state.dp_cp)   # every token: DP x CP
        if self.pipeline is not None and self.pipeline.tied is not None:
            # the first stage's updated E to the last stage, overlapping the next step's start:
            # the runner lands it before the last stage's first forward (and _land_tied_weight
            # before a save or the end of training)
            self.pipeline.tied.sync_weight(wait=False)
        return result

    def _moe_modules(self) -> list:
        """The GPT models (or pipeline chunks) of this rank that hold MoE layers."""
        if not hasattr(self, "_moe_cache"):
            found = [m for m in self.model.modules() if hasattr(m, "moe_layers") and m.moe_layers()]
            self._moe_cache = found
        return self._moe_cache

    def _land_tied_weight(self) -> None:
        """Complete the asynchronous tied-embedding sync of the last step (pipeline only)."""
        if self.pipeline is not None and self.pipeline.tied is not None:
            self.pipeline.tied.land_weight()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss over ``eval_iters`` global batches, continuing the validation stream."""
        self.model.eval()
        loader = self.make_loader("valid", self.ts.consumed_valid_samples)
        total, n = 0.0, self.cfg.training.eval_iters * self.layout.micro_batches
        if self.pipeline is not None:   # the forward-only schedule, m micro-batches at a time
            from pretrain.pipeline_stage import micro_batches
            for _ in range(self.cfg.training.eval_iters):
                loss = self.pipeline.runner.forward_only(
                    micro_batches(loader, self.layout.micro_batches, self.state.device, self.state,
                                  self.cfg.parallel.cp_comm_type))
                total += (loss or 0.0) / self.cfg.training.eval_iters
        else:
            for _ in range(n):
                total += self._micro_batch_loss(next(loader)).item() / n
        self.ts.consumed_valid_samples += self.cfg.training.eval_iters * self.layout.global_batch
        _close(loader)
        loss = float(self._step_agreement(torch.full((), total, dtype=torch.float64,
                                                      device=self.state.device))[0].item())
        ppl = math.exp(min(loss, 20.0))
        self.metrics.log({"lm loss validation": loss, "lm loss validation ppl": ppl}, self.ts.iteration)
        log.info("validation at iteration %d | lm loss %.4f | ppl %.3f", self.ts.iteration, loss, ppl)
        return loss

    def save(self) -> None:
        if not self.cfg.checkpoint.save:
            return
        self._land_tied_weight()
        resume.save(self.cfg.checkpoint.save, self.ts, self.model, self.optimizer, self.state,
                    self.cfg, rng=self.rng, keep_last=self.cfg.checkpoint.keep_last_checkpoints or 0,
                    background=self.async_save)
        self.last_saved_iteration = self.ts.iteration
        if self.async_save is not None:   # the stall is checkpoint-save-time; this is part of it
            self.metrics.log({"checkpoint-async-wait-time": self.async_save.last_wait,
                              "checkpoint-async-host-bytes": float(self.async_save.snapshot.bytes)},
                             self.ts.iteration)

    def _poll_async_save(self, stats: IntervalStats) -> None:
        """--async-save: commit the save in flight once every rank's write has ended (one small
        all-reduce per step while one is in flight; the commit is off the clock)."""
        start = time.perf_counter()
        with comm.unrecorded(self.state.world):
            committed = self.async_save.poll()
        if committed:
            seconds = time.perf_counter() - start
            stats.off_clock += seconds
            self.metrics.log({"checkpoint-commit-time": seconds}, self.ts.iteration)

    def _finish_async_save(self) -> None:
        """Wait for the background write of the last save and commit it (every rank, together)."""
        if self.async_save is None:
            return
        if self.async_save.in_flight:
            log.info("waiting for the background checkpoint write to finish")
            with comm.unrecorded(self.state.world):
                waited = self.async_save.finish()
            self.metrics.log({"checkpoint-async-wait-time": waited}, self.ts.iteration)
        self.async_save.close()

    def _arm_memory_snapshot(self) -> None:
        """--memory-snapshot-step K: start recording (CUDA) before the first step."""
        step = self.cfg.logging.memory_snapshot_step
        if step is None or step <= self.ts.iteration:
            return
        from pretrain.memory_snapshot import MemorySnapshot, shared_directory
        where = shared_directory(self.metrics.run_dir or self.cfg.checkpoint.save, self.state.world,
                                 self.state.device)
        self.memory_snapshot = MemorySnapshot(step, where, self.state.rank, self.state.device)
        self.memory_snapshot.start()

    def _checkpoint(self, stats: IntervalStats) -> None:
        if self.cfg.checkpoint.save:
            self._settle(stats)   # the skip counts it stores; a non-finite stop raises first
            self._off_clock(stats, "checkpoint-save-time", self.save)

    def _off_clock(self, stats: IntervalStats, scalar: str, work) -> None:
        """Run ``work`` (evaluation, a checkpoint save) outside the training clock: its seconds are
        logged as ``scalar`` and left out of the interval's iteration-time, and its collectives are
        left out of the comm ledger, whose per-step bytes are training traffic only."""
        start = time.perf_counter()
        with comm.unrecorded(self.state.world):   # one ledger serves the world, TP and DP groups
            work()
        seconds = time.perf_counter() - start
        stats.off_clock += seconds
        self.metrics.log({scalar: seconds}, self.ts.iteration)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _account_compile(self, stats: IntervalStats, on_clock: bool) -> None:
        """Seconds torch.compile spent since the last call (--compile): taken off the training
        clock when they fell inside a training step, logged as ``compile-time`` (the total)."""
        clock = self.compile_clock
        if clock is None or clock.seconds == self._compile_seen:
            return
        if on_clock:
            stats.off_clock += clock.seconds - self._compile_seen
        self._compile_seen = clock.seconds
        self.metrics.log({"compile-time": clock.seconds}, self.ts.iteration + 1)
        cache = clock.cache_counts()
        log.info("torch.compile: %.1f s compiling %d graph(s) so far (iteration %d; inductor cache "
                 "%d hits, %d misses)", clock.seconds, clock.compiles, self.ts.iteration + 1,
                 cache["hit"], cache["miss"])

    def _exit_interval_reached(self) -> bool:
        """--exit-interval N: stop after an iteration that is a multiple of N (Megatron's rule;
        the loop saves first, with --save)."""
        n = self.cfg.training.exit_interval
        if n is None or not self._due(n):
            return False
        log.info("stopping at iteration %d (--exit-interval %d)", self.ts.iteration, n)
        return True

    def _due(self, interval: int) -> bool:
        return self.ts.iteration % interval == 0

    def _advance(self, stats: IntervalStats) -> None:
        """Host counters of the iteration just run (its device values wait for :meth:`_settle`)."""
        self.ts.iteration += 1
        self.ts.consumed_train_samples += self.step_layout.global_batch
        stats.iterations += 1
        stats.samples += self.step_layout.global_batch

    def _new_interval(self) -> IntervalStats:
        return IntervalStats(ledger_mark=self.state.ledger.position)

    def _log_interval(self, stats: IntervalStats) -> None:
        wall = time.perf_counter() - stats.start
        seconds = (wall - stats.off_clock) / stats.iterations     # training only
        good = stats.iterations - stats.skipped
        # the throughput model counts the FLOPs of a nominal global batch: per nominal batch, a
        # ramp's smaller steps take proportionally less time
        nominal = seconds * self.layout.global_batch * stats.iterations / stats.samples
        m = {"lm loss": stats.loss_sum / good if good else float("nan"),
             "learning-rate": self.last_lr,
             "loss-scale": stats.last_loss_scale, "grad-norm": stats.last_grad_norm,
             "batch-size": float(self.step_layout.global_batch), "iteration-time": seconds,
             "tokens-per-second": self.layout.tokens_per_step / nominal,
             "throughput": self.throughput.tflops_per_rank(nominal),      # Megatron: TFLOP/s/GPU
             "mfu": self.throughput.mfu(nominal), **self.throughput.roofline(nominal),
             "skipped-iterations": float(self.ts.skipped_iterations),
             "consumed-samples": float(self.ts.consumed_train_samples),
             **memory_bytes(self.state.device), **self._model_state_bytes(),
             **self._comm_per_step(stats)}
        if self.pipeline is not None:
            m["pipeline/bubble-fraction"] = stats.bubble_sum / stats.iterations
        m.update(self._moe_interval_metrics())
        if self.stragglers is not None:   # one all-gather of 3 numbers per rank
            m.update(self.stragglers.interval(self.ts.iteration))
        self.metrics.log(m, self.ts.iteration)
        eta = wall / stats.iterations * (self.train_iters - self.ts.iteration)   # evals, saves too
        log.info("%s", console_line(m, self.ts.iteration, self.train_iters, eta))

    def _moe_interval_metrics(self) -> dict[str, float]:
        """Expert load, aux / z losses, drops (docs/moe.md) of every MoE layer: this rank's chunks
        merged, and under PP every stage's layers brought to every rank (the writer is stage 0)."""
        per_layer = {}
        for module in self._moe_modules():
            per_layer.update(module.pop_moe_metrics())
        model = self.cfg.model
        if self.pipeline is None or model.num_experts is None:
            return moe_metrics(per_layer, self.state.dp_cp)
        layers = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
        return moe_metrics(per_layer, self.state.dp_cp, self.state.pp, layers, model.num_experts,
                           self.state.device)

    def _comm_per_step(self, stats: IntervalStats) -> dict[str, float]:
        """Bytes this rank moved per step in DP and TP (and CP) collectives (ring volume, from the ledger),
        and the part of them that crossed hosts (group average, hybrid.perf.links); with PP also
        the bytes it sent to its neighbouring stages (activations forward, gradients back). DP
        counts the host-split DP groups of hybrid sharding, hpZ and qgZ too. The same two numbers
        per ledger group and op (``comm/dp-reduce_scatter-bytes-per-step``,
        ``comm/dp_inter_host-all_to_all-cross-host-bytes-per-step``, ...) for the ops that ran; the
        first interval's are logged once, split into the bytes inside hosts and across them."""
        groups = ("dp", "tp", "pp") if self.pipeline is not None else ("dp", "tp")
        if self.state.cp_size > 1:   # the CP attention's ring / all-to-all (issue 31)
            groups += ("cp",)
        out = {f"comm/{g}-{part}bytes-per-step": 0.0 for g in groups
               for part in ("", "cross-host-")}
        per_op: dict[tuple[str, str], list[float]] = {}   # (group, op) -> [bytes, cross-host bytes]
        for r in self.state.ledger.since(stats.ledger_mark):
            if (r.group == "pp" and r.op != "send") or (r.group == "cp" and r.op == "recv"):
                continue   # each point-to-point message once, at its sender
            group = "dp" if r.group.startswith("dp") else r.group   # with dp_intra_host, dp_inter_host
            if group in groups:
                out[f"comm/{group}-bytes-per-step"] += r.bytes_per_rank / stats.iterations
                out[f"comm/{group}-cross-host-bytes-per-step"] += (r.cross_host_bytes
                                                                   / stats.iterations)
                sums = per_op.setdefault((r.group, r.op), [0.0, 0.0])
                sums[0] += r.bytes_per_rank / stats.iterations
                sums[1] += r.cross_host_bytes / stats.iterations
        for (group, op), (total, cross) in per_op.items():
            out[f"comm/{group}-{op}-bytes-per-step"] = total
            out[f"comm/{group}-{op}-cross-host-bytes-per-step"] = cross
        if not self._links_logged and per_op:
            self._links_logged = True
            log.info("bytes per rank per step, measured (ledger, hybrid.perf.links):\n%s", "\n".join(
                describe_collectives([(g, op, t, c) for (g, op), (t, c) in per_op.items()])))
        self.state.ledger.discard()   # read: a long run's ledger must not grow (soak test)
        return out

    def _model_state_bytes(self) -> dict[str, float]:
        """This rank's model-state bytes per category, measured from the engine's storages now
        (stage 3's gathered parameters come and go), beside the paper's formula (ZeRO §5)."""
        report = getattr(self.optimizer, "memory_report", None)
        if report is None:
            return {}
        r = report()
        return {**{f"model-state/{c}-bytes": float(v) for c, v in r.measured.items()},
                **{f"model-state/{c}-paper-bytes": float(v) for c, v in r.formula.items()}}


def _close(loader) -> None:
    """Stop a prefetching loader's thread (plain iterators have nothing to stop)."""
    close = getattr(loader, "close", None)
    if close is not None:
        close()
