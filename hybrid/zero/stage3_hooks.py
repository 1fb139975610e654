"""When ZeRO-3 gathers and releases each unit's parameters (ZeRO paper §5.3 and §7.2.2).

Pos+g+p keeps only a 1/Nd chunk of every parameter; a unit (embedding, transformer layer, final
norm) is all-gathered just before it is used and released right after, once in forward and once in
backward, which is the 2Ψ of parameter all-gathers behind the paper's 3Ψ per step. Module hooks
drive it:

* forward pre-hook of unit i: wait for its gather (prefetched earlier) and *issue the next unit's
  gather* asynchronously, so that communication overlaps the current unit's compute. A small next
  unit (the final LayerNorm: under 1/16 of the largest unit) or one kept whole computes too little
  to hide a transfer behind it, so the look-ahead continues past it to the next real unit (the
  tied embedding after the last layer; the last layer at the start of backward);
* forward hook of unit i: release it, and hook its outputs' gradients: the hook runs when the
  gradient of the unit's output arrives, i.e. just before the unit's own backward; there the unit
  is gathered again and the previous unit prefetched;
* model forward hook: hooks the model's outputs so the start of backward prefetches the last unit.

Tied weights (the output layer reusing the word embedding): the units in ``tied`` are gathered again
after the last unit's forward and kept until the backward reaches the last unit, covering the output
layer's forward and backward with one gather. Units whose backward reads no parameter value (an
embedding lookup's gradient is a scatter-add of the output gradient) are not gathered in backward.
Together: every partitioned element is all-gathered exactly twice per step.

Releases in backward are driven by gradients: :class:`~hybrid.zero.stage3.ParameterPartitioning` releases
a unit when all of its parameters' gradients have been accumulated. Forward hooks that run during
backward (activation recompute) gather without prefetching and never release.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import torch
from torch import nn

from hybrid.zero.stage3_unit import ShardedUnit


def _on_output_grad(output, callback) -> bool:
    """Call ``callback`` once, when the first gradient of ``output``'s tensors arrives in backward
    (just before the backward of what produced them). Tensor hooks leave the outputs untouched, so
    later in-place updates of them stay legal. False when nothing in ``output`` needs a gradient."""
    if isinstance(output, torch.Tensor):
        tensors = [output]
    elif isinstance(output, (tuple, list)):
        tensors = [t for t in output if isinstance(t, torch.Tensor)]
    else:
        tensors = []
    tensors = [t for t in tensors if t.requires_grad]
    if not tensors:
        return False
    if len(tensors) == 1:
        tensors[0].register_hook(lambda grad: callback())
    else:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: callback(), mode="any")
    return True


class Stage3Scheduler:
    """Installs the gather / prefetch / release hooks on ``model`` and its sharding units.

    ``units[i]`` is the :class:`ShardedUnit` of ``modules[i]`` (None when all its parameters are
    persistent); ``tied`` the indices of units used again after the last unit (tied output layer);
    ``backward_reads[i]`` whether unit i's backward needs its parameter values.
    ``trace`` records (event, unit index) of the current step, for tests of the overlap order.
    """

    def __init__(self, model: nn.Module, modules: list[nn.Module], units: list[ShardedUnit | None],
                 *, tied: list[int], backward_reads: list[bool], prefetch: bool,
                 sizes: list[int] | None = None):
        """``sizes``: elements each unit computes with (default its own; with memory-centric
        tiling its tiles too), which decide the look-ahead's "small" units."""
        self.units, self.tied, self.backward_reads = units, list(tied), backward_reads
        self.prefetch = prefetch
        self.in_backward = False
        self.trace: list[tuple[str, int]] = []
        self.last = len(modules) - 1
        if sizes is None:
            sizes = [u.numel if u is not None else 0 for u in units]
        largest = max(sizes, default=0)
        # units the look-ahead passes over: kept whole (None) or too small to hide a transfer
        self.small = [u is None or 16 * n < largest for u, n in zip(units, sizes)]
        model.register_forward_pre_hook(self._model_pre_forward)
        model.register_forward_hook(self._model_post_forward)
        for i, module in enumerate(modules):
            module.register_forward_pre_hook(functools.partial(self._pre_forward, i))
            module.register_forward_hook(functools.partial(self._post_forward, i))

    # ---- primitives ------------------------------------------------------------------------
    def record(self, event: str, i: int) -> None:
        """Add (event, unit index) to this step's trace (the engine's gradient reductions too)."""
        self.trace.append((event, i))

    def gather(self, i: int | None, async_op: bool) -> None:
        unit = None if i is None else self.units[i]
        if unit is not None and not unit.gathered:
            if not unit.in_flight:
                self.trace.append(("gather", i))
            unit.gather(async_op=async_op)

    def release(self, i: int) -> None:
        unit = self.units[i]
        if unit is not None and unit.gathered:
            unit.release()
            self.trace.append(("release", i))

    def release_all(self) -> None:
        for i in range(len(self.units)):
            self.release(i)

    def _forward_after(self, i: int) -> Iterator[int]:
        """Units used after unit i in forward: the later layers, then the tied ones (lazily: the
        look-ahead stops at the first unit that is not small)."""
        return itertools.chain(range(i + 1, self.last + 1), self.tied)

    def _backward_after(self, i: int) -> Iterator[int]:
        """Units gathered after unit i in backward (those whose backward reads parameters)."""
        return (j for j in range(i - 1, -1, -1) if self.backward_reads[j])

    def _prefetch(self, upcoming: Iterator[int]) -> None:
        """Issue the gathers of the ``upcoming`` units in order, up to and including the first
        one that is not small (see the module docstring)."""
        for j in upcoming:
            self.gather(j, async_op=True)
            if not self.small[j]:
                return

    # ---- forward hooks ---------------------------------------------------------------------
    def _model_pre_forward(self, module, args) -> None:
        self.in_backward = False
        self.trace.clear()

    def _pre_forward(self, i: int, module, args) -> None:
        self.gather(i, async_op=False)
        self.trace.append(("forward", i))
        if self.prefetch and not self.in_backward:
            self._prefetch(self._forward_after(i))

    def _post_forward(self, i: int, module, args, output):
        self.trace.append(("forward_done", i))
        if not self.in_backward:
            self.release(i)
            if i == self.last:
                for t in self.tied:       # the tied output layer runs next
                    self.gather(t, async_op=False)
        if torch.is_grad_enabled():
            _on_output_grad(output, functools.partial(self._pre_backward, i))

    def _model_post_forward(self, module, args, output):
        if not (torch.is_grad_enabled() and _on_output_grad(output, self._backward_starts)):
            self.release_all()          # evaluation: nothing will come back for these units

    # ---- backward triggers -----------------------------------------------------------------
    def _backward_starts(self) -> None:
        self.in_backward = True
        self.trace.append(("backward", -1))
        if self.prefetch:
            self._prefetch(self._backward_after(self.last + 1))

    def _pre_backward(self, i: int) -> None:
        self.in_backward = True
        self.trace.append(("backward", i))
        if i == self.last:
            for t in self.tied:           # the output layer's backward is done
                if t != i:
                    self.release(t)
        if self.backward_reads[i]:
            self.gather(i, async_op=False)
        if self.prefetch:
            self._prefetch(self._backward_after(i))
