"""benchmarks/offload_bandwidth.py (issue 35 part 3): the file probe writes and reads back the size
asked for and turns the rates into the dry run's flags; the host link is left unmeasured on a CPU;
bad sizes are one error line."""

from __future__ import annotations

import pytest
import torch

from benchmarks import offload_bandwidth as ob


def test_file_probe_and_the_flags_it_suggests(tmp_path):
    r = ob.measure(size_mb=2, repeats=1, nvme_path=tmp_path / "nvme", device=torch.device("cpu"))
    assert r["bytes"] == 2 << 20 and r["host_to_device"] is None
    assert r["file_write"] > 0 and r["file_read"] > 0
    assert list((tmp_path / "nvme").iterdir()) == []          # the probe file is removed
    text = ob.report(r)
    assert "host link: no accelerator here, not measured" in text
    assert f"--nvme-offload-bandwidth {min(r['file_write'], r['file_read']) / 1e9:.2f}" in text


def test_bad_sizes_are_refused(capsys):
    assert ob.main(["--size-mb", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --size-mb and --repeats must be at least 1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_link_on_a_gpu():
    r = ob.measure(size_mb=64, repeats=3)
    assert r["host_to_device"] > 1e9 and r["device_to_host"] > 1e9   # any PCIe link does 1 GB/s
