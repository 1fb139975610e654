"""The convergence claim of docs/optimizer-precision.md (issue 33, "What it must show"): 300 steps
of the tiny-cpu GPT with bf16 Adam moments stay within the measured bound of the fp32-moment run -
every validation within 0.01, and within 0.005 from step 150 on (measured: 0.0098 and 0.0035).
Both runs through benchmarks/moment_precision_convergence.py (4 CPU ranks, the default corpus)."""

from __future__ import annotations

import pytest

from benchmarks import moment_precision_convergence as bench

pytestmark = pytest.mark.slow


def test_bf16_moments_stay_within_the_documented_bound_of_fp32_moments(tmp_path):
    (_, fp32_flags), (_, bf16_flags) = bench.VARIANTS[:2]
    cache = tmp_path / "cache"
    fp32 = dict(bench.train(tmp_path, "fp32", 300, 50, cache, fp32_flags)["validation"])
    bf16 = dict(bench.train(tmp_path, "bf16", 300, 50, cache, bf16_flags)["validation"])
    assert sorted(fp32) == sorted(bf16) == list(range(50, 301, 50))
    gaps = {step: abs(bf16[step] - fp32[step]) for step in fp32}
    assert max(gaps.values()) <= 0.01, gaps
    assert max(g for step, g in gaps.items() if step >= 150) <= 0.005, gaps
