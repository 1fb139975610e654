"""Pipeline schedules as data (GPipe: Huang et al. 2019; 1F1B: PipeDream-Flush, Narayanan et al.
2021 §2.2.1; interleaved 1F1B: same paper §2.2.2).

A schedule is, for each stage, the ordered list of :class:`Action` it runs in one step: a forward or
a backward of one micro-batch through one of its model chunks. One runner
(:mod:`hybrid.pipeline.runner`) executes any of them; :func:`simulate` executes them without
communication (unit costs per action), which checks that a schedule completes (every dependency is
met in some order, no stage waits forever) and measures its bubble against the formulas:

    1F1B and GPipe:   bubble = (p - 1) / (m + p - 1)           (idle time over step time)
    interleaved:      bubble = (p - 1) / (v * m + p - 1)

Dependencies: forward (i, virtual stage k) needs forward (i, k - 1); backward (i, k) needs forward
(i, k) and backward (i, k + 1). Virtual stage k = chunk * p + stage.

Memory (activations held): GPipe holds all m micro-batches' activations at its peak, 1F1B at most
p - stage of them; interleaved at most (p - stage - 1) * 2 + (v - 1) * p + 1 chunk activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.pipeline.config import PipelineConfig


@dataclass(frozen=True)
class Action:
    kind: str          # "F" forward or "B" backward
    micro_batch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


def gpipe(p: int, m: int, stage: int) -> list[Action]:
    """All forwards, then all backwards (in micro-batch order)."""
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(p: int, m: int, stage: int) -> list[Action]:
    """Warm up with p - stage - 1 forwards, then alternate one forward and one backward, then drain."""
    warmup = min(p - stage - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    return actions + [Action("B", i) for i in range(m - warmup, m)]


def interleaved(p: int, m: int, v: int, stage: int) -> list[Action]:
    """Megatron's interleaved 1F1B: micro-batches go through the chunks in groups of p; the k-th
    forward of a stage is micro-batch ``(k // (p v)) p + k % p`` on chunk ``(k // p) % v`` and
    backwards run the chunks in reverse."""
    total = m * v

    def unit(k: int, forward: bool) -> Action:
        chunk = (k // p) % v
        micro_batch = (k // (p * v)) * p + k % p
        return Action("F" if forward else "B", micro_batch, chunk if forward else v - 1 - chunk)

    warmup = total if m == p else min((p - stage - 1) * 2 + (v - 1) * p, total)
    actions = [unit(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [unit(warmup + i, True), unit(i, False)]
    return actions + [unit(k, False) for k in range(total - warmup, total)]


def build_schedule(config: PipelineConfig) -> list[list[Action]]:
    """The action list of every stage."""
    p, m, v = config.num_stages, config.num_micro_batches, config.num_model_chunks
    if config.schedule == "gpipe":
        return [gpipe(p, m, s) for s in range(p)]
    if config.schedule == "1f1b":
        return [one_f_one_b(p, m, s) for s in range(p)]
    return [interleaved(p, m, v, s) for s in range(p)]


def forward_only(config: PipelineConfig) -> list[list[Action]]:
    """Evaluation: every stage runs the forwards of its training schedule in their order and no
    backward. Dropping the backwards removes dependencies only, so the list completes whenever the
    training schedule does; no stage holds an activation past its forward."""
    return [[a for a in actions if a.kind == "F"] for actions in build_schedule(config)]


def bubble_formula(config: PipelineConfig) -> float:
    p, m, v = config.num_stages, config.num_micro_batches, config.num_model_chunks
    return (p - 1) / (v * m + p - 1)


@dataclass(frozen=True)
class Simulation:
    makespan: float
    busy: list[float]                      # per stage
    peak_in_flight: list[int]              # most chunk activations held at once, per stage

    @property
    def bubble(self) -> float:
        """Mean idle time per stage over the step time."""
        return sum(self.makespan - b for b in self.busy) / (len(self.busy) * self.makespan)


def simulate(config: PipelineConfig, forward_time: float = 1.0,
             backward_time: float = 2.0) -> Simulation:
    """Run the schedule with each forward of a chunk costing ``forward_time / v`` and each backward
    ``backward_time / v``, communication free; raises if it cannot complete (a deadlock)."""
    p, v = config.num_stages, config.num_model_chunks
    schedule = build_schedule(config)
    done: dict[tuple[str, int, int], float] = {}   # (kind, micro-batch, virtual stage) -> end time
    clock, position = [0.0] * p, [0] * p
    busy, held, peak = [0.0] * p, [0] * p, [0] * p
    while any(position[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] == len(schedule[s]):
                continue
            a = schedule[s][position[s]]
            k = a.chunk * p + s
            needs = ([("F", a.micro_batch, k - 1)] if a.kind == "F" and k > 0 else [])
            if a.kind == "B":
                needs = [("F", a.micro_batch, k)] + (
                    [("B", a.micro_batch, k + 1)] if k < p * v - 1 else [])
            if any(n not in done for n in needs):
                continue
            cost = (forward_time if a.kind == "F" else backward_time) / v
            start = max([clock[s]] + [done[n] for n in needs])
            clock[s] = start + cost
            busy[s] += cost
            done[(a.kind, a.micro_batch, k)] = clock[s]
            held[s] += 1 if a.kind == "F" else -1
            peak[s] = max(peak[s], held[s])
            position[s] += 1
            progressed = True
        if not progressed:
            stuck = {s: schedule[s][position[s]] for s in range(p) if position[s] < len(schedule[s])}
            raise RuntimeError(f"pipeline schedule deadlocks: stages wait on {stuck}")
    return Simulation(max(clock), busy, peak)
