"""Pipeline parallelism: the third dimension of the rank grid (Narayanan et al. 2021; GPipe).

:mod:`.config` validates a layout (stages, virtual stages, micro-batches) and assigns layers,
:mod:`.schedules` builds GPipe, 1F1B and interleaved 1F1B as lists of actions per stage (and
simulates them without communication), :mod:`.runner` executes one on this rank's model chunks with
point-to-point transfers through :mod:`hybrid.comm`, :mod:`.tied` keeps the tied word embedding of
the first and last stage in step, :mod:`.stage` shows a stage's chunks as one model to its ZeRO
engine and checkpoints.

The config and schedules import without torch (a launcher checks a layout before it starts any
rank); the runner, stage and tied embedding are imported on first use (PEP 562).
"""

import importlib

from hybrid.pipeline.config import SCHEDULES, PipelineConfig, PipelineConfigError
from hybrid.pipeline.schedules import Action, bubble_formula, build_schedule, simulate

__all__ = ["SCHEDULES", "Action", "PipelineConfig", "PipelineConfigError", "PipelineRunner",
           "StageChunks", "StepOutput", "TiedEmbedding", "bubble_formula", "build_schedule", "simulate"]

_ON_FIRST_USE = {"PipelineRunner": "runner", "StepOutput": "runner", "StageChunks": "stage",
                 "TiedEmbedding": "tied"}


def __getattr__(name: str):
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_ON_FIRST_USE[name]}"), name)
