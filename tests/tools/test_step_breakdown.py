"""tools/step_breakdown.py's categories, on a tiny real profile: a GEMM, a fused attention core,
elementwise ops, a cast, an optimizer step and a collective land in their own rows, and the rows
add up to the measured wall time."""

import time

import pytest
import torch
import torch.nn.functional as F

from tools.step_breakdown import (CATEGORIES, COMM_PREFIX, OPTIMIZER_RANGE, ProfiledOp, breakdown,
                                  categorize, profiled_ops)


def test_categorize_by_name_and_enclosing_range():
    assert categorize(ProfiledOp("aten::mm", 1.0, ())) == "GEMMs"
    assert categorize(ProfiledOp("aten::addmm", 1.0, ("aten::linear",))) == "GEMMs"
    assert categorize(ProfiledOp("aten::_scaled_dot_product_flash_attention_for_cpu", 1.0, ())) \
        == "attention core"
    assert categorize(ProfiledOp("aten::bmm", 1.0, ("aten::scaled_dot_product_attention",))) \
        == "attention core"                          # the math kernel's products stay attention
    assert categorize(ProfiledOp("## Call CompiledFxGraph fbd74ohd ##", 1.0, ())) \
        == "elementwise/norm/activation"             # inductor's fused kernels
    for around in ("_PackedCore", "autograd::engine::evaluate_function: _CoreBackward"):
        assert categorize(ProfiledOp("aten::bmm", 1.0, (around,))) == "attention core"
    compiled = ("## Call CompiledFxGraph f73qsblm ##", "CompiledFunction")
    for name in ("aten::bmm", "aten::baddbmm"):   # --compile: the core's products in the graph
        assert categorize(ProfiledOp(name, 1.0, compiled)) == "attention core"
    assert categorize(ProfiledOp("aten::mm", 1.0, compiled)) == "GEMMs"   # its weight GEMMs
    assert categorize(ProfiledOp("aten::bmm", 1.0, ())) == "GEMMs"        # elsewhere a GEMM
    assert categorize(ProfiledOp("aten::copy_", 1.0, ("aten::_to_copy", "aten::to"))) == "casts"
    assert categorize(ProfiledOp("aten::copy_", 1.0, ("aten::clone",))) \
        == "elementwise/norm/activation"             # a same-dtype copy is memory traffic
    assert categorize(ProfiledOp("aten::mul_", 1.0, ("x", OPTIMIZER_RANGE))) == "optimizer"
    assert categorize(ProfiledOp("aten::add_", 1.0, (COMM_PREFIX + "all_reduce",))) == "communication"
    assert categorize(ProfiledOp("gloo:all_reduce", 1.0, ())) == "communication"
    assert categorize(ProfiledOp("aten::view", 1.0, ())) is None            # metadata: overhead
    assert categorize(ProfiledOp("MyFunctionBackward", 1.0, ())) is None    # Python autograd


def test_breakdown_rest_is_framework_overhead():
    ops = [ProfiledOp("aten::mm", 50.0, ()), ProfiledOp("aten::gelu", 20.0, ()),
           ProfiledOp("aten::view", 5.0, ())]
    parts = breakdown(ops, 100.0)
    assert list(parts) == list(CATEGORIES)
    assert parts["GEMMs"] == 50 and parts["elementwise/norm/activation"] == 20
    assert parts["framework overhead (rest)"] == 30
    assert sum(parts.values()) == pytest.approx(100.0)


def test_tiny_profile_lands_in_its_categories():
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    q = k = v = torch.randn(1, 2, 64, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        torch.mm(a, b)
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        F.gelu(a)
        a.to(torch.bfloat16)
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            b.mul_(0.5)
        with torch.profiler.record_function(COMM_PREFIX + "all_reduce"):
            b.add_(1.0)
        wall = (time.perf_counter() - start) * 1e6
    parts = breakdown(profiled_ops(prof), wall)
    for category in ("GEMMs", "attention core", "elementwise/norm/activation", "casts",
                     "optimizer", "communication"):
        assert parts[category] > 0, (category, parts)
    assert sum(parts.values()) == pytest.approx(max(wall, sum(parts.values())))
    ops = profiled_ops(prof)
    assert {categorize(o) for o in ops if o.name == "aten::mm"} == {"GEMMs"}
    assert {categorize(o) for o in ops if o.name == "aten::mul_"} == {"optimizer"}
