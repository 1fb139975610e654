"""benchmarks/gpu_single.py's CPU smoke mode runs the code path of the GPU benchmark (plain-torch
baseline with SDPA and fused-or-not AdamW, our GPT at ZeRO stage 0 with full recompute) for 2 steps,
writes its JSON and prints its table (the 'ours fp8' row says "not available" while --fp8-format
does not exist, and the profiler summary is written beside the JSON); without CUDA the real
benchmark refuses with an error line. Issue 36: the Llama-3.2 shapes are the published ones, and the
micro-batch / recompute choice follows the memory model (none, then selective, then full)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_single


def test_cpu_smoke_mode_runs_two_steps(tmp_path, capsys):
    out = tmp_path / "gpu_single.json"
    rc = gpu_single.main(["--device", "cpu", "--size", "tiny", "--steps", "2", "--warmup", "0",
                          "--no-compile", "--micro-batch-size", "1", "--seq-length", "16",
                          "--recompute", "full", "--profile", "ours", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["variants"]] == ["torch", "ours", "ours fp8"]
    fp8 = result["variants"][2]
    options, _ = gpu_single.fp8_options()
    assert fp8["available"] == (options is not None)
    for r in result["variants"][:2]:
        assert r["hw_tflops"] > r["tflops"]   # full recompute: the hardware ran one more forward
        assert len(r["ms_all"]) == 2 and r["tokens_per_s"] > 0 and r["tflops"] > 0
        assert 4.0 < r["last_loss"] < 8.0   # ~ln(512) at initialisation: both trained the same task
    assert result["ours_vs_torch"] > 0
    printed = capsys.readouterr().out
    assert "| ours |" in printed and "| torch |" in printed and "target >= 0.95x" in printed
    assert "| HFU |" in printed
    profile = out.with_suffix(".profile.md").read_text()
    assert "## ours (2 steps)" in profile and "| kernel / op |" in profile


def test_without_cuda_the_benchmark_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the real benchmark runs (tools/gpu_check.sh)")
    assert gpu_single.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "needs CUDA" in err and "--device cpu --size tiny" in err


def test_peak_table_prefers_the_specific_name():
    assert gpu_single.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_single.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_single.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_single.peak_tflops("Some Future GPU") is None


def test_auto_size_is_the_largest_that_fits():
    small = gpu_single.estimate_bytes(gpu_single.SIZES["gpt2-small"], 4, 1024, "full")
    medium = gpu_single.estimate_bytes(gpu_single.SIZES["gpt2-medium"], 4, 1024, "full")
    assert gpu_single.pick_size("auto", (small + medium) / 2, 4, 1024, "full") == "gpt2-small"
    assert gpu_single.pick_size("auto", 80 * 2**30, 4, 1024, "full") == "gpt2-1.5B"


def test_llama32_shapes_are_the_published_ones():
    one, three = gpu_single.SIZES["llama3.2-1B"], gpu_single.SIZES["llama3.2-3B"]
    # published parameter counts (tied embeddings): 1.24B and 3.21B
    from hybrid.perf.flops import gpt_param_count
    for c, billions in ((one, 1.24), (three, 3.21)):
        n = gpt_param_count(c.num_layers, c.hidden_size, c.vocab_size, 0, heads=c.num_attention_heads,
                            arch=c.perf_architecture())
        assert abs(n / 1e9 - billions) < 0.01, (n, billions)
        assert not c.untie_embeddings_and_output_weights and c.swiglu and c.num_query_groups == 8


def test_setup_is_chosen_as_a_user_would():
    c = gpu_single.SIZES["llama3.2-3B"].replace(seq_length=4096)
    est = lambda b, r: gpu_single.estimate_bytes(c, b, 4096, r)   # noqa: E731
    # memory for micro-batch 2 without recompute: none, the largest micro-batch that fits
    assert gpu_single.choose_setup(c, 4096, est(2, "none") + 1, None, "auto") == (2, "none")
    # not even one without recompute, but with the selective recompute: selective before full
    budget = (est(1, "selective") + est(1, "none")) / 2
    b, mode = gpu_single.choose_setup(c, 4096, budget, None, "auto")
    assert mode == "selective" and b >= 1 and est(b, "selective") <= budget < est(b + 1, "selective")
    assert gpu_single.choose_setup(c, 4096, est(1, "full") / 2, None, "auto") is None
    model, hardware = gpu_single.step_flops(c, 2, 4096, "full")
    assert 1.25 < hardware / model < 4 / 3   # one more forward of the layers, not of the output layer
