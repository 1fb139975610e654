"""Measure the bandwidths ZeRO-Infinity's §4 analysis needs on this machine (issue 35, part 3): pinned
host memory <-> accelerator (the PCIe link offloaded optimizer states, parameters and checkpoints
cross) and a directory's file write / read (the NVMe path of --offload-nvme-path), then print the
flags that declare them to the dry run.

    python -m benchmarks.offload_bandwidth [--size-mb 256] [--repeats 5] [--nvme-path DIR]

One GPU's figures: with several GPUs per host sharing PCIe switches and drives, divide the NVMe
figure by the ranks that share the drive. The file is written with fsync and its pages dropped
from the page cache (posix_fadvise DONTNEED) before the read, so the read comes from the device
where the OS honours the hint; a tmpfs directory measures memory, not a drive.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _median_rate(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds)


def host_link_bandwidth(device: torch.device, nbytes: int, repeats: int) -> tuple[float, float] | None:
    """(host -> device, device -> host) bytes/s of pinned copies of ``nbytes``; None on a CPU."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)   # warm-up: allocations, the copy engine
    torch.cuda.synchronize(device)
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        rates.append(_median_rate(nbytes, times))
    return rates[0], rates[1]


def file_bandwidth(directory: Path, nbytes: int, repeats: int) -> tuple[float, float]:
    """(write, read) bytes/s of a ``nbytes`` file in ``directory``: write + fsync, then drop the
    file's cached pages and read it back."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20) * (max(nbytes, 1 << 20) // (1 << 20))
    writes, reads = [], []
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        path = Path(scratch) / "probe.bin"
        for _ in range(repeats):
            start = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, block)
                os.fsync(fd)
            finally:
                os.close(fd)
            writes.append(time.perf_counter() - start)
            fd = os.open(path, os.O_RDONLY)
            try:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                start = time.perf_counter()
                while os.read(fd, 1 << 24):
                    pass
                reads.append(time.perf_counter() - start)
            finally:
                os.close(fd)
    return _median_rate(len(block), writes), _median_rate(len(block), reads)


def measure(size_mb: int = 256, repeats: int = 5, nvme_path: Path | None = None,
            device: torch.device | None = None) -> dict:
    if size_mb < 1 or repeats < 1:
        raise ValueError(f"--size-mb and --repeats must be at least 1, got {size_mb}, {repeats}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nbytes = size_mb << 20
    link = host_link_bandwidth(device, nbytes, repeats)
    files = file_bandwidth(nvme_path, nbytes, repeats) if nvme_path is not None else None
    return {"device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
            "bytes": nbytes, "host_to_device": link and link[0], "device_to_host": link and link[1],
            "file_write": files and files[0], "file_read": files and files[1]}


def report(r: dict) -> str:
    gb = 1e9
    lines = [f"{r['bytes'] >> 20} MiB per transfer on {r['device']}"]
    flags = []
    if r["host_to_device"] is None:
        lines.append("host link: no accelerator here, not measured")
    else:
        lines.append(f"host -> device {r['host_to_device'] / gb:.2f} GB/s, device -> host "
                     f"{r['device_to_host'] / gb:.2f} GB/s (pinned)")
        flags.append(f"--host-offload-bandwidth "
                     f"{min(r['host_to_device'], r['device_to_host']) / gb:.2f}")
    if r["file_write"] is not None:
        lines.append(f"file write {r['file_write'] / gb:.2f} GB/s (fsync), read "
                     f"{r['file_read'] / gb:.2f} GB/s (cache dropped)")
        flags.append(f"--nvme-offload-bandwidth {min(r['file_write'], r['file_read']) / gb:.2f}")
    if flags:
        lines.append("declare them to the dry run: " + " ".join(flags))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tools._cli import ArgumentParser, run_cli
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nvme-path", type=Path, help="directory on the drive to offload to")

    def run(args_list):
        args = parser.parse_args(args_list)
        print(report(measure(args.size_mb, args.repeats, args.nvme_path)))
        return 0
    return run_cli(run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
