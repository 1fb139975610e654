"""The GEMM roofline (hybrid.perf.roofline, hybrid.perf.gemm_rate): the GEMMs of a step add up to
Megatron's FLOPs less the attention core (hybrid.perf.flops), the GEMM-bound time is their FLOPs
over the measured rates, and the rate cache measures a shape once per dtype, thread count, torch
version and device."""

import json

import pytest
import torch

from hybrid.perf import gemm_rate
from hybrid.perf.architecture import Architecture
from hybrid.perf.flops import model_flops_per_iteration
from hybrid.perf.gemm_rate import GemmRateCache
from hybrid.perf.roofline import distinct_shapes, gemm_bound_seconds, gemm_flops, training_gemms
from hybrid.perf.throughput import attention_core_flops_per_iteration

LLAMA = Architecture(query_groups=2, swiglu=True, bias=False, rmsnorm=True, untied=True,
                     learned_positions=False, ffn_hidden=704)


@pytest.mark.parametrize("tp,dp,accum", [(1, 1, 1), (2, 1, 3), (4, 2, 2)])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_gemm_flops_are_megatrons_less_the_attention_core(tp, dp, accum, recompute):
    b, s, l, h, v = 4, 128, 3, 256, 8192
    gemms = training_gemms(micro_batch=b, seq=s, layers=l, hidden=h, vocab_padded=v, tp=tp,
                           micro_batches=accum, recomputed_layers=l if recompute == "full" else 0)
    batch = b * accum * dp
    model = model_flops_per_iteration(batch, s, l, h, v, full_recompute=recompute == "full")
    core = attention_core_flops_per_iteration(batch, s, l, h, recompute)
    assert gemm_flops(gemms) * tp * dp == pytest.approx(model - core, rel=1e-12)


def test_gemm_flops_with_llama_options():
    b, s, l, h, a, v = 2, 64, 2, 256, 8, 4096
    gemms = training_gemms(micro_batch=b, seq=s, layers=l, hidden=h, vocab_padded=v, tp=2,
                           heads=a, arch=LLAMA)
    model = model_flops_per_iteration(b, s, l, h, v, heads=a, arch=LLAMA)
    core = 3 * 4.0 * b * s * s * h * l
    assert gemm_flops(gemms) * 2 == pytest.approx(model - core, rel=1e-12)
    # grouped-query QKV: h + 2 g d columns, d = h / a
    assert gemms[0].shape == (b * s, h, (h + 2 * 2 * (h // a)) // 2)


def test_a_recomputed_layer_adds_one_layer_forward():
    kw = dict(micro_batch=2, seq=32, layers=2, hidden=64, vocab_padded=256)
    extra = gemm_flops(training_gemms(**kw, recomputed_layers=1)) - gemm_flops(training_gemms(**kw))
    assert extra == 2 * (2 * 32) * 12 * 64 * 64            # 2 T 12 h^2: the four GEMMs of a layer


def test_gemm_bound_time_is_flops_over_rates():
    b, s, l, h, v = 4, 128, 4, 256, 8192
    gemms = training_gemms(micro_batch=b, seq=s, layers=l, hidden=h, vocab_padded=v)
    uniform = {shape: 2e11 for shape in distinct_shapes(gemms)}
    expected = (model_flops_per_iteration(b, s, l, h, v)
                - attention_core_flops_per_iteration(b, s, l, h, "none")) / 2e11
    assert gemm_bound_seconds(gemms, uniform) == pytest.approx(expected, rel=1e-12)
    # the output layer's three shapes at half the rate: their FLOPs count twice
    slow = {g.shape for g in gemms if g.name.startswith("logits")}
    rates = {shape: 1e11 if shape in slow else 2e11 for shape in uniform}
    logit_flops = sum(g.flops for g in gemms if g.name.startswith("logits"))
    assert gemm_bound_seconds(gemms, rates) == pytest.approx(expected + logit_flops / 2e11)
    with pytest.raises(ValueError, match="no measured GEMM rate"):
        gemm_bound_seconds(gemms, {})


def test_training_gemms_reject_bad_shapes():
    with pytest.raises(ValueError, match="not divisible by TP degree 3"):
        training_gemms(micro_batch=1, seq=8, layers=1, hidden=64, vocab_padded=256, tp=3)
    with pytest.raises(ValueError, match="recomputed_layers"):
        training_gemms(micro_batch=1, seq=8, layers=1, hidden=64, vocab_padded=256,
                       recomputed_layers=2)


@pytest.fixture
def counted(monkeypatch):
    """Real measurements, counted per (shape, dtype)."""
    calls = []
    real = gemm_rate.measure_gemm_rate

    def measure(shape, dtype, device="cpu", repeats=5):
        calls.append((shape, dtype))
        return real(shape, dtype, device, repeats=1)

    monkeypatch.setattr(gemm_rate, "measure_gemm_rate", measure)
    return calls


def test_cache_measures_once_then_hits(tmp_path, counted):
    path = tmp_path / "sub" / "gemm-rates.json"
    shapes = [(32, 64, 48), (48, 32, 64)]
    first = GemmRateCache(path).rates(shapes, torch.float32)
    assert len(counted) == 2 and all(r > 0 for r in first.values())
    cache = GemmRateCache(path)   # a later run: a new object reading the same file
    assert cache.rates(shapes, torch.float32) == first
    assert cache.measured == [] and len(counted) == 2
    stored = json.loads(path.read_text())
    assert len(stored) == 2 and all("threads=" in k and "torch=" in k and "cpu=" in k for k in stored)


def test_cache_key_changes_measure_again(tmp_path, counted, monkeypatch):
    path, shape = tmp_path / "rates.json", (16, 32, 64)
    GemmRateCache(path).rates([shape], torch.float32)
    GemmRateCache(path).rates([shape], torch.bfloat16)           # dtype
    assert [d for _, d in counted] == [torch.float32, torch.bfloat16]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        GemmRateCache(path).rates([shape], torch.float32)        # thread count
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(gemm_rate, "device_name", lambda device="cpu": "cpu=another model")
    GemmRateCache(path).rates([shape], torch.float32)            # CPU / GPU model
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    GemmRateCache(path).rates([shape], torch.float32)            # torch version
    GemmRateCache(path).rates([(16, 32, 65)], torch.float32)     # shape
    assert len(counted) == 6
    assert len(json.loads(path.read_text())) == 6


def test_unreadable_cache_is_measured_again_and_rewritten(tmp_path, counted, caplog):
    path = tmp_path / "rates.json"
    path.write_text("{not json")
    rates = GemmRateCache(path).rates([(8, 8, 8)], torch.float32)
    assert len(counted) == 1 and "unreadable GEMM-rate cache" in caplog.text
    assert list(json.loads(path.read_text()).values()) == [rates[(8, 8, 8)]]


def test_pipeline_stages_split_the_whole_models_gemms():
    """PP 2: the first stage runs its layers only, the last its layers and the output layer; together
    they are the whole model's GEMMs."""
    kw = dict(micro_batch=2, seq=32, hidden=64, vocab_padded=256, micro_batches=4)
    whole = gemm_flops(training_gemms(layers=4, **kw))
    first = gemm_flops(training_gemms(layers=2, logits=False, **kw))
    last = gemm_flops(training_gemms(layers=2, **kw))
    assert first + last == pytest.approx(whole, rel=1e-12)
    assert not any(g.name.startswith("logits") for g in training_gemms(layers=2, logits=False, **kw))
