"""tests/gpu: the CUDA suite (docs/gpu.md). Every test here carries the ``cuda`` marker and is skipped
with the reason "CUDA is not available" where ``torch.cuda.is_available()`` is False, so CPU CI only
pays for importing these modules (nothing touches a GPU at import or collection time).

Run on a CUDA machine: ``python -m pytest tests/gpu -m cuda`` (tools/gpu_check.sh does, and more).
Figures the tests measure (overlap fractions, fragmentation, ...) go through the ``figures`` fixture:
printed, and appended as JSON lines to ``$GPU_FIGURES`` when that is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# cuBLAS picks deterministic reductions only with a fixed workspace, which must be set before the
# first cuBLAS call of the process (and is inherited by spawned ranks): the bit-equality tests need it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest   # noqa: E402
import torch   # noqa: E402

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="CUDA is not available")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.cuda)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture
def figures(request):
    """``figures(name, **values)``: report a measured figure (see the module docstring)."""
    def record(name: str, **values) -> None:
        row = {"test": request.node.nodeid, "figure": name, **values}
        print(json.dumps(row))
        path = os.environ.get("GPU_FIGURES")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
    return record
