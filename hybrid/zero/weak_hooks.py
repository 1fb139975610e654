"""Post-accumulate-grad hooks that do not keep their owner alive.

The ZeRO engines learn that a parameter's gradient is complete from a hook registered with
``Tensor.register_post_accumulate_grad_hook``. Such a hook lives in the parameter, so a hook closing
over its engine makes a cycle engine -> parameters -> hook -> engine that runs through the C++
tensor, where Python's cycle collector cannot follow it while autograd also holds the tensor:
deleting the model and its engine then freed nothing, neither the parameters nor the gradient
buffer (nor, at stage 3, the shards, masters and moments). Found on a GPU, where a second engine
built in the same process started with the first one's memory still allocated.

Here each hook holds its owner weakly, and the hooks are removed when the owner is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch


def add_post_accumulate_hooks(owner: object, method: str,
                              params: Iterable[tuple[torch.Tensor, tuple]]) -> None:
    """For each ``(param, args)`` register a hook calling ``owner.<method>(*args, param)`` after
    autograd has accumulated ``param.grad``; the hooks neither keep ``owner`` alive nor outlive it."""
    ref = weakref.ref(owner)

    def make(args: tuple):
        def hook(param: torch.Tensor) -> None:
            target = ref()
            if target is not None:
                getattr(target, method)(*args, param)
        return hook

    handles = [param.register_post_accumulate_grad_hook(make(args)) for param, args in params]
    weakref.finalize(owner, _remove, handles)


def _remove(handles) -> None:
    for handle in handles:
        handle.remove()
