"""One default for each knob: the training config's sections (pretrain.sections) and the library
configs and perf-model assumptions they feed start from the same value, and the layout policy
(hybrid.zero_policy) is the one the engine's factory, the config checks and the perf model apply.

The defaults are read by introspection (``dataclasses.fields``, ``inspect.signature``), so changing
one side alone fails here. A knob whose two defaults differ on purpose is listed in ``DELIBERATE``
with the reason, and must still differ (a stale entry fails too). Every field of the library configs
the sections feed is either compared or listed in ``NO_FLAG`` (set by the trainer from other flags,
or a library-only setting), so a new field needs a decision here.
"""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta

import pytest
from torch import nn

from hybrid.adamw_config import AdamWConfig
from hybrid.moe.router import Router
from hybrid.offload.budget import OffloadConfig
from hybrid.parallel_state import DEFAULT_TIMEOUT, ParallelState
from hybrid.perf.hardware import Cluster
from hybrid.perf.memory import device_memory
from hybrid.perf.pipeline import Layout, estimate_layout
from hybrid.pipeline.config import PipelineConfig
from hybrid.topology import Topology
from hybrid.zero import build_zero_optimizer
from hybrid.zero.config import LossScaleConfig, ZeroConfig
from hybrid.zero_policy import (DEFAULT_BUCKET_ELEMENTS, layout_refusal, runnable_stages,
                                stage_with_pipeline)
from pretrain.config import TrainConfigError
from models.gpt.config import GPTConfig
from pretrain.sections import LoggingSection, OptimizerSection, ParallelSection

SECTIONS = {"parallel": ParallelSection, "optimizer": OptimizerSection, "logging": LoggingSection,
            "model": GPTConfig}


def field_default(cls, name: str):
    """The default of dataclass field ``cls.name`` (its factory's value for a default_factory)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def parameter_default(function, name: str):
    return inspect.signature(function).parameters[name].default


def section_default(key: str):
    section, name = key.split(".")
    return field_default(SECTIONS[section], name)


# section field -> [(what reads the same knob, its default)]
FEEDS = {
    "parallel.zero_bucket_size": [
        ("ZeroConfig.bucket_size", field_default(ZeroConfig, "bucket_size")),
        ("hybrid.perf.memory.device_memory(bucket_elements)",
         parameter_default(device_memory, "bucket_elements")),
        ("hybrid.zero_policy.DEFAULT_BUCKET_ELEMENTS", DEFAULT_BUCKET_ELEMENTS)],
    "parallel.zero_hybrid_shard": [("ZeroConfig.hybrid_shard", field_default(ZeroConfig, "hybrid_shard"))],
    "parallel.zero_hpz": [("ZeroConfig.hpz", field_default(ZeroConfig, "hpz"))],
    "parallel.tile_factor": [("ZeroConfig.tile_factor", field_default(ZeroConfig, "tile_factor"))],
    "parallel.zero_quantized_weights_format": [
        ("ZeroConfig.quantized_weights_format", field_default(ZeroConfig, "quantized_weights_format"))],
    "parallel.max_working_memory": [
        ("ZeroConfig.max_working_memory", field_default(ZeroConfig, "max_working_memory"))],
    "parallel.zero_quantized_weights": [
        ("ZeroConfig.quantized_weights", field_default(ZeroConfig, "quantized_weights"))],
    "parallel.zero_quantized_gradients": [
        ("ZeroConfig.quantized_gradients", field_default(ZeroConfig, "quantized_gradients"))],
    "parallel.offload_optimizer": [("OffloadConfig.mode", field_default(OffloadConfig, "mode"))],
    "parallel.offload_params": [("OffloadConfig.params", field_default(OffloadConfig, "params"))],
    "parallel.offload_nvme_path": [("OffloadConfig.nvme_path", field_default(OffloadConfig, "nvme_path"))],
    "parallel.host_memory_budget": [
        ("OffloadConfig.host_memory_budget", field_default(OffloadConfig, "host_memory_budget"))],
    "parallel.tensor_model_parallel_size": [
        ("Topology.tensor_parallel_size", field_default(Topology, "tensor_parallel_size"))],
    "parallel.pipeline_model_parallel_size": [
        ("Topology.pipeline_parallel_size", field_default(Topology, "pipeline_parallel_size"))],
    "parallel.expert_model_parallel_size": [
        ("Topology.expert_model_parallel_size", field_default(Topology, "expert_model_parallel_size")),
        ("ParallelState.from_launch_env(expert_model_parallel_size)",
         parameter_default(ParallelState.from_launch_env, "expert_model_parallel_size"))],
    "parallel.allow_tp_across_nodes": [
        ("Topology.allow_tp_across_nodes", field_default(Topology, "allow_tp_across_nodes"))],
    "parallel.gpus_per_node": [
        ("Topology.gpus_per_node", field_default(Topology, "gpus_per_node")),
        ("hybrid.perf Cluster.gpus_per_node", field_default(Cluster, "gpus_per_node"))],
    "parallel.distributed_timeout_minutes": [
        ("hybrid.parallel_state.DEFAULT_TIMEOUT", DEFAULT_TIMEOUT / timedelta(minutes=1)),
        ("ParallelState.initialize(timeout)",
         parameter_default(ParallelState.initialize, "timeout") / timedelta(minutes=1))],
    "parallel.dp_transport": [
        ("ParallelState.initialize(dp_transport)",
         parameter_default(ParallelState.initialize, "dp_transport"))],
    "optimizer.initial_loss_scale": [
        ("LossScaleConfig.initial_scale", field_default(LossScaleConfig, "initial_scale"))],
    "optimizer.min_loss_scale": [("LossScaleConfig.min_scale", field_default(LossScaleConfig, "min_scale"))],
    "optimizer.loss_scale_window": [
        ("LossScaleConfig.growth_interval", field_default(LossScaleConfig, "growth_interval"))],
    "optimizer.hysteresis": [("LossScaleConfig.hysteresis", field_default(LossScaleConfig, "hysteresis"))],
    "optimizer.adam_beta1": [("AdamWConfig.betas[0]", field_default(AdamWConfig, "betas")[0])],
    "optimizer.adam_eps": [("AdamWConfig.eps", field_default(AdamWConfig, "eps"))],
    "optimizer.exp_avg_dtype": [("AdamWConfig.exp_avg_dtype",
                                 field_default(AdamWConfig, "exp_avg_dtype"))],
    "optimizer.exp_avg_sq_dtype": [("AdamWConfig.exp_avg_sq_dtype",
                                    field_default(AdamWConfig, "exp_avg_sq_dtype"))],
    "optimizer.weight_decay": [("AdamWConfig.weight_decay", field_default(AdamWConfig, "weight_decay"))],
    # the MoE model fields and the router they configure (hybrid.moe.router.Router)
    **{f"model.{field}": [(f"hybrid.moe.router.Router({arg})", parameter_default(Router, arg))]
       for field, arg in (("moe_router_score_function", "score_function"),
                          ("moe_router_pre_softmax", "pre_softmax"),
                          ("moe_router_topk_scaling_factor", "topk_scaling_factor"),
                          ("moe_router_load_balancing_type", "load_balancing_type"),
                          ("moe_aux_loss_coeff", "aux_loss_coeff"),
                          ("moe_z_loss_coeff", "z_loss_coeff"),
                          ("moe_router_enable_expert_bias", "enable_expert_bias"),
                          ("moe_router_bias_update_rate", "bias_update_rate"),
                          ("moe_expert_capacity_factor", "capacity_factor"))},
}

# section field -> (library config field, why the two defaults differ)
DELIBERATE = {
    "parallel.zero_stage": ("ZeroConfig.stage", "the library builds plain data parallelism unless "
                            "asked; the trainer runs Pos, the same 2-Psi DP traffic for less memory"),
    "optimizer.clip_grad": ("ZeroConfig.clip_grad", "the library does not clip unless asked (the "
                            "numerics tests compare with an unclipped reference); the trainer clips "
                            "at 1.0 as Megatron-LM does"),
    "optimizer.lr": ("AdamWConfig.lr", "the library mirrors torch.optim.AdamW; the trainer uses a "
                     "GPT pretraining rate"),
    "optimizer.adam_beta2": ("AdamWConfig.betas[1]", "the library mirrors torch.optim.AdamW; the "
                             "trainer uses GPT-3's 0.95"),
}
DELIBERATE_LIBRARY = {"ZeroConfig.stage": field_default(ZeroConfig, "stage"),
                      "ZeroConfig.clip_grad": field_default(ZeroConfig, "clip_grad"),
                      "AdamWConfig.lr": field_default(AdamWConfig, "lr"),
                      "AdamWConfig.betas[1]": field_default(AdamWConfig, "betas")[1]}

# Fields of the fed library configs without a section default of their own: set by the trainer from
# other flags (precision, accumulation, kernels) or library-only settings.
NO_FLAG = {
    ZeroConfig: {"precision", "overlap_communication", "gradient_accumulation_steps",
                 "stage3_prefetch", "stage3_param_persistence_threshold", "loss_scale",
                 "alignment_bytes", "grad_accumulation_fusion",
                 "muon"},   # built from --optimizer muon and the --muon-* flags (test_muon_flags.py)
    LossScaleConfig: {"growth_factor", "backoff_factor"},
    AdamWConfig: {"kernel"},
    OffloadConfig: {"block_elems", "kernel"},
    Topology: {"world_size"},
}


@pytest.mark.parametrize("key", sorted(FEEDS))
def test_section_default_is_the_default_of_what_it_feeds(key):
    ours = section_default(key)
    for where, theirs in FEEDS[key]:
        assert ours == theirs, f"--{key.split('.')[1]} defaults to {ours!r}, {where} to {theirs!r}"


@pytest.mark.parametrize("key", sorted(DELIBERATE))
def test_deliberate_differences_still_differ(key):
    where, reason = DELIBERATE[key]
    assert reason and section_default(key) != DELIBERATE_LIBRARY[where], (
        f"{key} and {where} agree now: move the pair from DELIBERATE to FEEDS")


@pytest.mark.parametrize("library", sorted(NO_FLAG, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_field_of_a_fed_config_is_decided(library):
    named = {where.split(" ")[-1] for pairs in FEEDS.values() for where, _ in pairs}
    named |= {where for where, _ in DELIBERATE.values()}
    for f in dataclasses.fields(library):
        qualified = f"{library.__name__}.{f.name}"
        decided = (f.name in NO_FLAG[library]
                   or any(n == qualified or n.startswith(qualified + "[") for n in named))
        assert decided, f"{qualified}: compare it with its section field in FEEDS, or list it in NO_FLAG"


def test_unflagged_values_agree():
    """Defaults that are properties of the sections, not fields: the schedule and the precision."""
    assert ParallelSection().schedule == field_default(PipelineConfig, "schedule")
    assert OptimizerSection().precision == field_default(ZeroConfig, "precision")


# ---- the layout policy: one decision, read by the engine, the config and the perf model -------------
def test_zero3_with_pipeline_is_refused_by_config_engine_and_perf_model_with_one_message():
    message = layout_refusal(3, 2)
    assert message and layout_refusal(3, 1) is None and layout_refusal(2, 2) is None
    with pytest.raises(TrainConfigError) as config_error:
        ParallelSection(zero_stage=3, pipeline_model_parallel_size=2)
    state = ParallelState.dry_run(Topology(4, 1, gpus_per_node=4, pipeline_parallel_size=2), 0)
    with pytest.raises(ValueError) as engine_error:
        build_zero_optimizer(nn.Linear(2, 2), state, ZeroConfig(stage=3), AdamWConfig())
    with pytest.raises(ValueError) as perf_error:
        estimate_layout(Layout(1, 2, 2, 1, 3, "full", 1), layers=4, hidden=64, heads=4, seq=32,
                        vocab=128, global_batch=8)
    assert str(config_error.value) == str(engine_error.value) == str(perf_error.value) == message


def test_perf_model_estimates_the_stage_the_engine_runs():
    """Stage 2 under PP is modelled as the stage 1 the engine builds; a layout search tries only
    the stages an engine can run."""
    model = dict(layers=4, hidden=64, heads=4, seq=32, vocab=128, global_batch=8)
    for pp in (1, 2):
        runs = stage_with_pipeline(2, pp)
        asked = estimate_layout(Layout(1, pp, 2, 1, 2, "full", 1), **model)
        ran = estimate_layout(Layout(1, pp, 2, 1, runs, "full", 1), **model)
        assert (asked.memory_bytes, asked.time_s) == (ran.memory_bytes, ran.time_s)
    assert runnable_stages(1) == (0, 1, 2, 3) and runnable_stages(2) == (0, 1)


def test_the_perf_models_peak_is_the_device_tables_v100():
    """--peak-tflops defaults to the detected device's peak (pretrain.device_peaks); the paper's
    V100 in the perf model (Cluster.peak_flops) and that table's V100 row are one number."""
    from pretrain.device_peaks import peak_tflops_of
    assert peak_tflops_of("Tesla V100-SXM3-32GB") == field_default(Cluster, "peak_flops") / 1e12
