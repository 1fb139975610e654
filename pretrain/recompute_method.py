"""Megatron-LM's ``--recompute-method uniform|block`` and ``--recompute-num-layers N`` on a
full-recompute plan of :mod:`hybrid.recompute` (``--recompute full | full-pa | full-pa-cpu``, or
Megatron's ``--recompute-granularity full``):

    uniform   every layer is recomputed, N consecutive layers checkpointed as one unit (only every
              N-th layer input is kept; the plan's ``granularity``)
    block     only the first N layers of each model chunk (a pipeline stage, or each virtual stage
              of the interleaved schedule) are recomputed; the others keep their activations
"""

from __future__ import annotations

import dataclasses


def apply_recompute_method(plan, cfg, pipeline=None):
    """``plan`` shaped by the config's --recompute-method (unchanged without one); ``pipeline``:
    the run's :class:`~hybrid.pipeline.PipelineConfig` (None without PP), whose model chunks
    ``block`` counts its layers in."""
    t = cfg.training
    if t.recompute_method is None:
        return plan
    if t.recompute_method == "uniform":
        return dataclasses.replace(plan, granularity=t.recompute_num_layers)
    chunks = ([pipeline.layer_range(s, c) for s in range(pipeline.num_stages)
               for c in range(pipeline.num_model_chunks)] if pipeline else [(0, len(plan.modes))])
    modes = ["none"] * len(plan.modes)
    for start, stop in chunks:
        for i in range(start, min(stop, start + t.recompute_num_layers)):
            modes[i] = plan.modes[i]
    return dataclasses.replace(plan, modes=tuple(modes))
