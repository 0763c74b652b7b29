"""Selective activation checkpointing (torch's design, as two dispatch modes): inside a checkpointed
layer, the results of the expensive ops are saved in the forward and returned in the recomputation, the
cheap rest recomputed.

Saved (``saved_by_selective``): the GEMMs (matmuls whose reduction dim is at least an eighth of their output
width: not LoRA's rank-r up projection; an in-place GEMM such as ``addmm_`` too, its result written back in
recomputation), attention without dropout, fastft's delta-rule scan and ``lora_linear``'s forward (its output
and the rank-r product as one op). A result something writes into later
in the layer (an in-place op, or a kernel autograd does not see) is named in ``skip`` and recomputed instead
(``fastft.memory_measure`` finds them on the first step).

    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=selective_context)
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["saved_by_selective", "selective_context", "op_results"]


_MATMULS = {  # op -> positions of its two operands
    "aten::mm": (0, 1),
    "aten::bmm": (0, 1),
    "aten::addmm": (1, 2),
    "aten::addmm_": (1, 2),
    "aten::baddbmm": (1, 2),
    "aten::baddbmm_": (1, 2),
    "aten::_scaled_mm": (0, 1),
    "aten::_grouped_mm": (0, 1),
}
_IN_PLACE = {"aten::addmm_", "aten::baddbmm_"}  # write their result into their first argument
_SAVED = {  # attention forwards and fastft's ops: saved unless they draw random numbers
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "torch_attn::_varlen_attn",
    "fastft::delta_rule_chunk_scan",
    "fastft::lora_linear_forward",  # LoRA's output and x @ A^T: the low-rank product is not run again
}


def saved_by_selective(func, args, kwargs=None) -> bool:
    """Whether selective checkpointing saves the result of op ``func`` called with ``args``/``kwargs`` (see the
    module docstring). Never an op with dropout: skipping it in the recomputation would shift the random
    numbers every later op draws; never one that writes into an argument, but an in-place GEMM (``addmm_``)."""
    schema = func._schema
    name = schema.name
    if name in _SAVED:
        for i, arg in enumerate(schema.arguments):
            if arg.name == "dropout_p":
                p = (kwargs or {}).get("dropout_p", args[i] if i < len(args) else 0.0)
                return not p
        return True
    operands = _MATMULS.get(name)
    if operands is None or (schema.is_mutable and name not in _IN_PLACE):
        return False
    a, b = args[operands[0]], args[operands[1]]
    return 8 * a.shape[-1] >= b.shape[-1]


class _Selective(TorchDispatchMode):
    """Selective checkpointing, as two dispatch modes sharing ``store``: in the forward (``replay=False``) the
    results of the ops ``saved_by_selective`` picks (but the calls in ``skip``: something writes into their
    results later in the layer) are kept; in the recomputation those ops return them instead of running (an
    in-place GEMM writes its kept result into its argument). A kept result modified in place after all is a
    ``RuntimeError`` in the recomputation."""

    def __init__(self, store: dict, replay: bool, skip: frozenset) -> None:
        super().__init__()
        self.store, self.replay, self.skip = store, replay, skip
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not saved_by_selective(func, args, kwargs):
            return func(*args, **kwargs)
        key = (func, self.counts.get(func, 0))
        self.counts[func] = key[1] + 1
        if key in self.skip:
            return func(*args, **kwargs)
        if not self.replay:
            out = func(*args, **kwargs)
            # each result and its version once the op is done (autograd bumps an in-place op's after this mode
            # returns); t itself, not a detach, which here would share no version counter
            bump = int(func._schema.name in _IN_PLACE)
            self.store[key] = [(t, t._version + bump) for t in op_results(out)], out
            return out
        kept = self.store.pop(key, None)
        if kept is None:  # recomputed a second time (backward with retain_graph): run it
            return func(*args, **kwargs)
        tensors, out = kept
        if any(t._version != v for t, v in tensors):
            raise RuntimeError(
                f"fastft selective checkpointing: the result of {func} was modified in place after it was saved"
            )
        if func._schema.name in _IN_PLACE:
            return args[0].copy_(tensors[0][0])
        return out


def op_results(out) -> list:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def selective_context(skip: frozenset = frozenset()):
    """A checkpoint ``context_fn``: selective checkpointing (see ``_Selective``); ``skip``: op calls
    (``(op, nth call)``) not to save."""
    store: dict = {}
    return _Selective(store, False, skip), _Selective(store, True, skip)
