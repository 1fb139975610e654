"""Pipeline parallelism: the third dimension of the rank grid (Narayanan et al. 2021; GPipe).

:mod:`.config` validates a layout (stages, virtual stages, micro-batches) and assigns layers,
:mod:`.schedules` builds GPipe, 1F1B and interleaved 1F1B as lists of actions per stage (and
simulates them without communication), :mod:`.runner` executes one on this rank's model chunks with
point-to-point transfers through :mod:`hybrid.comm`, :mod:`.tied` keeps the tied word embedding of
the first and last stage in step, :mod:`.stage` shows a stage's chunks as one model to its ZeRO
engine and checkpoints.
"""

from hybrid.pipeline.config import SCHEDULES, PipelineConfig, PipelineConfigError
from hybrid.pipeline.runner import PipelineRunner, StepOutput
from hybrid.pipeline.schedules import Action, bubble_formula, build_schedule, simulate
from hybrid.pipeline.stage import StageChunks
from hybrid.pipeline.tied import TiedEmbedding

__all__ = ["SCHEDULES", "Action", "PipelineConfig", "PipelineConfigError", "PipelineRunner",
           "StageChunks", "StepOutput", "TiedEmbedding", "bubble_formula", "build_schedule", "simulate"]
