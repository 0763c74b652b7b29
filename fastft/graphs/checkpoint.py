"""CUDA graphs for checkpointed layers: a layer's forward, and its recompute + backward, one replay each.

    y = fastft.graphed_checkpoint(layer, x, **kwargs)
    # fastft.offloaded_checkpoint(layer, x, **kwargs) in values and gradients, in a few launches per layer

``layer`` is an ``nn.Module``, or a bound method or ``functools.partial`` of one (what transformers hands
its checkpoint function). The first call with a new *signature* (``fastft.graphs.policy``: the tensors'
shapes, dtypes, devices and ``requires_grad``; the other arguments' values; a ``PackedSeqInfo`` padded to
bounds that only grow; the layer's mode, trainable parameters and autocast) warms the layer up and captures
its two graphs (``fastft.graphs.capture``) into the device's one graph pool (``fastft.graphs.memory``). Each
call copies its tensors into static buffers shared by every signature and layer (an argument that is the
unchanged tensor last copied, such as the rotary tables every layer gets, is not copied again), replays,
and copies the outputs out. The first tensor argument is offloaded as ``offloaded_checkpoint`` does
(``offload_config``). Parameter gradients go through autograd, so DDP's and other hooks on parameters run.

Few signatures: pad the token count to a few values (``fastft.graphs.buckets``, which ``apply(model, graphs=True)``
does). Past ``MAX_SIGNATURES`` signatures of a layer its least-used graphs are dropped; ``capture_count()``
counts the captures (one per layer and signature, and again after the pool is renewed). ``policy="auto"``
captures layers only where their eager forwards are launch-bound, like layers deciding together
(``fastft.graphs.policy``), and runs a layer whose signatures keep changing (more than a quarter of its calls
capture, past ``MAX_SIGNATURES`` captures) eagerly from then on.

A layer that draws random numbers (dropout) is refused with ``ValueError``: the replayed recompute would
draw other ones than the forward. ``offloaded_checkpoint`` runs the call instead, with a warning once per
layer and reason, when the capture fails (a host sync or host-dependent work inside the layer), when the
layer modifies its tensor arguments in place, when it or a submodule has module hooks (a replay would not
run them), when an argument is neither a tensor, a ``PackedSeqInfo`` nor hashable, and with
``context_fn`` or ``debug``; and silently where no graph applies: grad disabled, no tensor argument,
tensors off the GPU, nothing that requires grad, and under ``policy="auto"`` a GPU-bound layer.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types
import warnings

import torch
from torch.utils import _pytree as pytree

from ..offload import OffloadConfig, check_offload_config, offloaded_checkpoint
from ..packing import PackedSeqInfo
from . import memory
from .capture import TENSOR, CaptureError, Replay, capture, tensors
from .policy import POLICIES, LayerGraphs, describe, identity, launch_bound, timed_eager

__all__ = ["graphed_checkpoint", "capture_count"]

MAX_SIGNATURES = 16  # graphs kept per layer (a token-count octave has 8 buckets); past it the least-used is dropped
GRAPH_DEVICES = ("cuda",)
_STATE = "_fastft_graphs"  # in a graphed layer's __dict__: its LayerGraphs
_captures = [0]  # captures since import (one per layer and signature)


def capture_count() -> int:
    """How many times a layer's graphs were captured (one per layer and signature, recaptures included)
    since fastft was imported."""
    return _captures[0]


def layer_graphs(module: torch.nn.Module) -> LayerGraphs | None:
    """The graphs and decisions of a layer that went through ``graphed_checkpoint`` (None for any other)."""
    return module.__dict__.get(_STATE)


def _module_call(function, args, kwargs):
    """(module, callable, positional args, keyword args) of ``function(*args, **kwargs)``: ``function`` is a
    module, a bound method of one, or a ``functools.partial`` of either or of an unbound method and its
    module."""
    target, pre_args, pre_kwargs = function, (), {}
    if isinstance(function, functools.partial):
        target, pre_args, pre_kwargs = function.func, function.args, function.keywords
    module = target if isinstance(target, torch.nn.Module) else getattr(target, "__self__", None)
    if module is None and pre_args and isinstance(pre_args[0], torch.nn.Module) and inspect.isfunction(target):
        # an unbound forward and its module: transformers >= 5.24 checkpoints ``partial(forward, layer, ...)``
        module, pre_args = pre_args[0], pre_args[1:]
        target = types.MethodType(target, module)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            "graphed_checkpoint needs a module call (an nn.Module, a bound method of one, or a functools.partial "
            "of either or of an unbound method and its module): its trainable parameters get their gradients from "
            f"the graph; got {type(function).__name__}"
        )
    return module, target, (*pre_args, *args), {**pre_kwargs, **kwargs}


def _layer_device(module, x: torch.Tensor) -> torch.device:
    """The CUDA device of the layer's first parameter (where it computes), else ``x``'s."""
    p = next(module.parameters(), None)
    return p.device if p is not None and p.device.type == "cuda" else x.device


def _hooked(module) -> bool:
    """Whether the module or one of its submodules has module hooks (other than profiler ranges, see
    ``fastft.audit``): a replay would not run them."""
    for m in module.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks):
            if any(not getattr(h, "profiler_range_only", False) for h in hooks.values()):
                return True
    return False


def _warn(state: LayerGraphs, module, why: str) -> None:
    if why not in state.warned:
        state.warned.add(why)
        warnings.warn(
            f"fastft: {type(module).__name__} runs without CUDA graphs (offloaded_checkpoint instead): {why}",
            RuntimeWarning,
            stacklevel=3,
        )


def graphed_checkpoint(
    function,
    *args,
    offload_config: OffloadConfig | None = None,
    preserve_rng_state: bool = True,
    use_reentrant: bool | None = None,
    context_fn=None,
    determinism_check: str = "default",
    debug: bool = False,
    policy: str = "always",
    **kwargs,
):
    """``fastft.offloaded_checkpoint(function, *args, **kwargs)`` replayed as CUDA graphs (see the module
    docstring); the same options, which the eager fallback takes. ``function`` must be a module call.
    ``policy``: ``"always"`` (capture every layer) or ``"auto"`` (only launch-bound layers)."""
    if use_reentrant:
        raise ValueError("graphed_checkpoint is non-reentrant; use_reentrant must be False or None")
    check_offload_config(offload_config)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    module, target, call_args, call_kwargs = _module_call(function, args, kwargs)
    options = dict(
        offload_config=offload_config,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
    )
    if context_fn is not None:
        options["context_fn"] = context_fn

    def eager():
        return offloaded_checkpoint(function, *args, **options, **kwargs)

    leaves, spec = pytree.tree_flatten((call_args, call_kwargs))
    x = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
    if not torch.is_grad_enabled() or x is None or x.device.type not in GRAPH_DEVICES:
        return eager()
    if not any(t.requires_grad for t in itertools.chain(tensors(leaves), module.parameters())):
        return eager()  # no gradient to compute
    device = _layer_device(module, x)
    if any(isinstance(t, (torch.Tensor, PackedSeqInfo)) and t.device != device for t in leaves):
        # a model split over GPUs (accelerate's device_map): the layer's own hook would move these inside the
        # call; moved here, they are the graphs' inputs on the layer's device, and autograd takes their
        # gradients back
        leaves = [t.to(device) if isinstance(t, (torch.Tensor, PackedSeqInfo)) else t for t in leaves]
    state = module.__dict__.get(_STATE)
    if state is None:
        state = module.__dict__[_STATE] = LayerGraphs()
    why = state.off or ("context_fn is given" if context_fn is not None else "debug=True" if debug else None)
    if why is None and _hooked(module):
        why = "it (or a submodule) has forward or backward hooks, which a replay would not run"
    if why is None:
        try:
            descs = tuple(describe(t, state) for t in leaves)
        except TypeError:
            kinds = {type(t).__name__ for t in leaves if not isinstance(t, (torch.Tensor, PackedSeqInfo))}
            why = f"an argument is neither a tensor, a PackedSeqInfo nor hashable ({', '.join(sorted(kinds))})"
    if why is not None:
        _warn(state, module, why)
        return eager()
    if policy == "auto" and not launch_bound(state):
        return timed_eager(state, module, device, eager)
    state.calls += 1
    autocast = torch.is_autocast_enabled(device.type)
    key = (spec, descs, module.training, autocast, torch.get_autocast_dtype(device.type) if autocast else None)
    graphs = state.graphs.get(key)
    if graphs is not None and (graphs.identity != identity(module) or graphs.statics.epoch != memory.epoch(device)):
        del state.graphs[key]  # parameters replaced or requires_grad changed, or the pool renewed: capture again
        graphs = None
    if graphs is None:
        if policy == "auto" and state.captures >= MAX_SIGNATURES and state.captures * 4 > state.calls:
            state.off = f"its signatures keep changing ({state.captures} captures in {state.calls} calls)"
            _warn(state, module, state.off)
            return eager()
        while len(state.graphs) >= MAX_SIGNATURES:  # drop the least-used graphs
            del state.graphs[min(state.graphs, key=lambda k: state.graphs[k].uses)]
        memory.make_room(device, tensors(leaves))
        trainable = tuple((tuple(p.shape), p.dtype) for p in module.parameters() if p.requires_grad)
        statics = memory.statics_for((key, type(module), trainable), leaves, descs, device)
        try:
            graphs = capture(module, target, spec, leaves, statics, device)
        except CaptureError as e:
            state.off = f"capturing it failed ({e})"
            _warn(state, module, state.off)
            return eager()
        state.graphs[key] = graphs
        state.captures += 1
        _captures[0] += 1
    graphs.uses += 1
    outs = Replay.apply(graphs, leaves, offload_config, *tensors(leaves), *graphs.params)
    it = iter(outs)
    return pytree.tree_unflatten([next(it) if o is TENSOR else o for o in graphs.out_leaves], graphs.out_spec)
