"""Dense 16-bit (bf16/fp16 tensor-core, no sparsity) peak TFLOP/s of common GPUs, the default
denominator of MFU (``--peak-tflops``), from the vendors' data sheets.

The first entry whose every word is in ``torch.cuda.get_device_name()`` wins, so specific names
(H100 PCIe) come before general ones (H100). A CPU has no such table value: its MFU is not
reported; ``perf/gemm-bound-fraction`` measures the step against this machine's own GEMM rate.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PEAK_16BIT_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("V100",), 125.0), (("A100",), 312.0), (("A10G",), 70.0), (("A10",), 125.0),
    (("A40",), 150.0), (("A30",), 165.0), (("L40S",), 362.0), (("L40",), 181.0), (("L4",), 121.0),
    (("H100", "PCIe"), 756.0), (("H100", "NVL"), 835.0), (("GH200",), 989.0), (("H100",), 989.0),
    (("H200",), 989.0), (("H20",), 148.0), (("GB200",), 2500.0), (("B200",), 2250.0),
    (("B100",), 1750.0), (("T4",), 65.0), (("MI300X",), 1307.0), (("MI250X",), 383.0),
)


def peak_tflops_of(device_name: str) -> float | None:
    """The table's dense 16-bit peak for a device name, None when it is not in the table."""
    for words, tflops in PEAK_16BIT_TFLOPS:
        if all(w in device_name for w in words):
            return tflops
    return None


def device_peak_tflops(device: torch.device) -> tuple[float | None, str]:
    """(peak TFLOP/s or None, where it came from) for the device a rank trains on."""
    if device.type != "cuda":
        return None, (f"a {device.type.upper()} has no table peak: MFU is not reported; "
                      f"perf/gemm-bound-fraction compares each step with this machine's measured "
                      f"GEMM rate; pass --peak-tflops to set one")
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops_of(name)
    if peak is None:
        return None, f"{name} is not in pretrain.device_peaks: MFU is not reported; pass --peak-tflops"
    return peak, f"dense bf16/fp16 peak of the detected {name}"


def run_peak_tflops(configured: float | None, state) -> float | None:
    """The MFU peak of a run: --peak-tflops (``configured``), else the detected device's (None:
    unknown, no MFU); rank 0 says which at start-up."""
    peak, why = ((configured, "--peak-tflops") if configured is not None
                 else device_peak_tflops(state.device))
    if state.rank == 0:
        log.info("MFU peak: %s (%s)", f"{peak:g} TFLOP/s per device" if peak else "unknown", why)
    return peak
