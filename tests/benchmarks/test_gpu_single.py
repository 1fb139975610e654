"""benchmarks/gpu_single.py's CPU smoke mode runs the code path of the GPU benchmark (plain-torch
baseline with SDPA and fused-or-not AdamW, our GPT at ZeRO stage 0 with full recompute) for 2 steps,
writes its JSON and prints its table; without CUDA the real benchmark refuses with an error line."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_single


def test_cpu_smoke_mode_runs_two_steps(tmp_path, capsys):
    out = tmp_path / "gpu_single.json"
    rc = gpu_single.main(["--device", "cpu", "--size", "tiny", "--steps", "2", "--warmup", "0",
                          "--no-compile", "--micro-batch-size", "1", "--seq-length", "16",
                          "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["variants"]] == ["torch", "ours"]
    for r in result["variants"]:
        assert len(r["ms_all"]) == 2 and r["tokens_per_s"] > 0 and r["tflops"] > 0
        assert 4.0 < r["last_loss"] < 8.0   # ~ln(512) at initialisation: both trained the same task
    assert result["ours_vs_torch"] > 0
    printed = capsys.readouterr().out
    assert "| ours |" in printed and "| torch |" in printed and "target >= 0.95x" in printed


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
