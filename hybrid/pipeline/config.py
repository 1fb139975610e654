"""Pipeline layout checks (Narayanan et al. 2021 §2.2): stages, virtual stages, micro-batches.

:class:`PipelineConfig` validates itself against the model's layer count with messages that name the
fix, and says which layers each (stage, model chunk) holds: virtual stage ``chunk * p + stage`` of
``p * v`` holds ``num_layers / (p * v)`` consecutive layers (Megatron's interleaved assignment).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def default_schedule(layers_per_virtual_stage: int | None) -> str:
    """The schedule when none is named: interleaved with virtual stages, else 1F1B."""
    return "1f1b" if layers_per_virtual_stage is None else "interleaved"


class PipelineConfigError(ValueError):
    """An invalid pipeline layout; the message says what to change."""


@dataclass(frozen=True)
class PipelineConfig:
    num_stages: int                 # p, --pipeline-model-parallel-size
    num_micro_batches: int          # m per step and DP rank
    num_layers: int                 # L of the whole model
    schedule: str = default_schedule(None)
    num_model_chunks: int = 1       # v: L / (p * --num-layers-per-virtual-pipeline-stage)

    def __post_init__(self) -> None:
        p, m, v, layers = self.num_stages, self.num_micro_batches, self.num_model_chunks, self.num_layers
        if self.schedule not in SCHEDULES:
            raise PipelineConfigError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got "
                                      f"{self.schedule!r}")
        for name, value in (("pipeline-model-parallel size", p), ("micro-batches per step", m),
                            ("virtual pipeline stages", v), ("number of layers", layers)):
            if not isinstance(value, int) or value < 1:
                raise PipelineConfigError(f"{name} must be a positive integer, got {value!r}")
        if layers % (p * v):
            raise PipelineConfigError(
                f"{layers} layers do not split evenly into {p} pipeline stages x {v} virtual stages "
                f"= {p * v} chunks; choose --num-layers a multiple of {p * v} or other degrees")
        if self.schedule == "interleaved":
            if v < 2:
                raise PipelineConfigError(
                    "the interleaved schedule needs at least 2 model chunks per stage; set "
                    "--num-layers-per-virtual-pipeline-stage below num_layers / pipeline size")
            if m < p or m % p:
                raise PipelineConfigError(
                    f"the interleaved schedule needs the micro-batches per step ({m}) to be a "
                    f"multiple of the pipeline-model-parallel size {p} (and at least {p}); raise "
                    f"--global-batch-size or lower the pipeline size")
        elif v != 1:
            raise PipelineConfigError(f"virtual pipeline stages ({v}) need the interleaved "
                                      f"schedule, not {self.schedule!r}")

    @classmethod
    def from_layers_per_virtual_stage(cls, num_stages: int, num_micro_batches: int, num_layers: int,
                                      layers_per_virtual_stage: int | None,
                                      schedule: str | None = None) -> "PipelineConfig":
        """Megatron's flags: ``--num-layers-per-virtual-pipeline-stage`` sets v (:meth:`chunks_per_stage`)."""
        v = cls.chunks_per_stage(num_stages, num_layers, layers_per_virtual_stage)
        return cls(num_stages, num_micro_batches, num_layers,
                   schedule or default_schedule(layers_per_virtual_stage), v)

    @staticmethod
    def chunks_per_stage(num_stages: int, num_layers: int, layers_per_virtual_stage: int | None) -> int:
        """v = L / (p x ``--num-layers-per-virtual-pipeline-stage``); 1 without the flag."""
        if layers_per_virtual_stage is None:
            return 1
        if layers_per_virtual_stage < 1 or num_layers % (num_stages * layers_per_virtual_stage):
            raise PipelineConfigError(
                f"{num_layers} layers are not a whole number of {num_stages} stages x "
                f"{layers_per_virtual_stage} layers per virtual stage; choose a divisor of "
                f"{num_layers // num_stages}")
        return num_layers // (num_stages * layers_per_virtual_stage)

    @property
    def layers_per_chunk(self) -> int:
        return self.num_layers // (self.num_stages * self.num_model_chunks)

    def layer_range(self, stage: int, chunk: int = 0) -> tuple[int, int]:
        """[start, stop) of the layers of model chunk ``chunk`` on ``stage``."""
        start = (chunk * self.num_stages + stage) * self.layers_per_chunk
        return start, start + self.layers_per_chunk

    def is_first(self, stage: int, chunk: int) -> bool:
        return stage == 0 and chunk == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return stage == self.num_stages - 1 and chunk == self.num_model_chunks - 1
