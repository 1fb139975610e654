"""Regional ``torch.compile`` of the GPT's transformer layers (torchtitan's per-block compile; see
docs/compile.md): each layer's ``forward`` is replaced by a compiled one, the modules stay where they
are, so parameter names, checkpoints and the hooks on the layer modules are unchanged.

* **Hooks stay outside.** ``nn.Module.__call__`` runs the module's hooks (ZeRO-3's gather, release and
  prefetch, :mod:`hybrid.zero.stage3_hooks`) and then ``self.forward``: compiling ``forward`` compiles
  the layer's arithmetic only, so the hooks run eagerly, once per call, exactly as without compile.
* **One graph for every layer.** Dynamo treats the parameters as graph inputs, so layers of the same
  shapes share one compiled graph (the compile cost does not grow with the depth).
* **TP collectives graph-break.** On a group of more than one rank the autograd Functions of
  :mod:`hybrid.tensor_parallel` that communicate run eagerly between compiled regions (their
  collectives go through hybrid.comm's ledger and overlap asynchronously; docs/compile.md says why);
  on one rank they are identities and compile with the rest. The selective-recompute checkpoint of
  the attention core runs eagerly too (:func:`hybrid.recompute.checkpoint`).
* **MoE layers** compile too; the expert-parallel dispatchers' ``dispatch`` / ``combine``
  (communication, sizes read on the host) and the fp32 grouped GEMM (torch 2.13 traces
  ``torch._grouped_mm`` in bf16 only) run eagerly between compiled regions (docs/moe.md).
* **KV-cache decoding runs eagerly**: each new position would be a new graph.
* **A token layout** (:class:`~models.gpt.token_layout.TokenLayout`, issue 31) is an argument of the
  compiled forward: the per-token rotary angles compile with the layer, the document-masked or
  context-parallel core (``ParallelAttention.layout_core``: host-side block planning, CP
  communication) runs eagerly between compiled regions.

The compiled code is cached on disk by inductor (FX graph and AOT-autograd caches) under
``cache_dir``, so a restart with the same model and torch reuses it.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn


class CompileUnsupported(ValueError):
    """This environment cannot compile (no C++ compiler, no Triton, an unsupported Python)."""


class CompileClock:
    """Wall seconds spent compiling since construction: from the start to the end of each dynamo
    compile (tracing, AOT autograd, inductor, C++/Triton builds) and of each backward graph compiled
    lazily at its first use, from dynamo's compile callbacks (nested compiles count once)."""

    def __init__(self):
        from torch._dynamo.callback import callback_handler
        self.seconds, self.compiles = 0.0, 0
        self._started: float | None = None
        self._handler = callback_handler
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)

    def _on_start(self, args) -> None:
        self._started = time.perf_counter()

    def _on_end(self, args) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.compiles += 1
            self._started = None

    @staticmethod
    def cache_counts() -> dict[str, int]:
        """Hits and misses of inductor's FX graph cache in this process (a warm restart hits)."""
        from torch._dynamo.utils import counters
        return {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss")}

    def close(self) -> None:
        self._handler.remove_start_callback(self._on_start)
        self._handler.remove_end_callback(self._on_end)


def check_compile_support(device: torch.device) -> None:
    """Raise :class:`CompileUnsupported` naming what is missing for inductor on ``device``."""
    import torch._dynamo
    if not torch._dynamo.is_dynamo_supported():
        raise CompileUnsupported("--compile: torch.compile does not support this Python/platform; "
                                 "drop --compile or use a Python that torch supports")
    if device.type == "cpu":
        import torch._inductor.config as inductor
        compiler = os.environ.get("CXX") or inductor.cpp.cxx[-1]
        if shutil.which(compiler) is None:
            raise CompileUnsupported(f"--compile on CPU needs a C++ compiler for inductor, but "
                                     f"{compiler!r} is not on PATH; install g++ (or set CXX) or "
                                     f"drop --compile")
    elif device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            raise CompileUnsupported("--compile on CUDA needs Triton for inductor; install the "
                                     "triton package matching torch or drop --compile")
    else:
        raise CompileUnsupported(f"--compile supports CPU and CUDA, not {device.type}; drop --compile")


def use_cache_dir(cache_dir: str | Path) -> Path:
    """Point inductor's on-disk caches (FX graphs, AOT autograd, C++/Triton kernels) at
    ``cache_dir`` (torch reads the location from ``TORCHINDUCTOR_CACHE_DIR``)."""
    path = Path(cache_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def _compiled_forward(layer: nn.Module, compiled):
    """The layer's new ``forward``: the compiled one, except for KV-cache decoding (eager)."""
    eager = layer.forward

    @functools.wraps(eager)
    def forward(x: torch.Tensor, cache=None, start: int = 0, layout=None) -> torch.Tensor:
        if cache is not None:
            return eager(x, cache, start)
        if layout is not None:   # positions traced in; the attention's layout core runs eagerly
            return compiled(x, None, 0, layout)
        return compiled(x)
    return forward


def compile_layers(*models: nn.Module, cache_dir: str | Path | None = None) -> CompileClock:
    """Compile each transformer layer of ``models`` (their ``layers``: a model, or a pipeline
    stage's chunks) in place; returns the one clock that accumulates the compile time (compilation
    happens at the first forward and backward). ``cache_dir``: inductor's cache directory (default:
    torch's). Idempotent per layer."""
    check_compile_support(models[0].state.device)
    if cache_dir is not None:
        use_cache_dir(cache_dir)
    for layer in (layer for model in models for layer in model.layers):
        if getattr(layer, "compiled", False):
            continue
        layer.forward = _compiled_forward(layer, torch.compile(layer.forward))
        layer.compiled = True
    return CompileClock()
