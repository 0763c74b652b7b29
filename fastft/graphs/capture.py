"""Capture and replay of one layer's two CUDA graphs for one signature (``fastft.graphs``).

``capture`` runs the layer once without and once with grad on the side stream (Triton compiles, cuBLAS
workspaces; the memory from the graph pool, ``fastft.graphs.memory``), then captures the forward without
grad, and the recompute with ``torch.autograd.grad`` of the outputs with respect to the inputs that
require grad and the layer's trainable parameters. Each graph copies its results into static buffers and
frees everything else it allocated before it ends, so no graph keeps memory of the pool alive. ``Replay``
is the autograd Function around the two replays.
"""

from __future__ import annotations

import contextlib
import gc

import torch
from torch.utils import _pytree as pytree

from ..offload import OffloadedInput, offloader_for
from . import memory
from .policy import identity


class CudaGraph:
    """``body()`` captured as one CUDA graph into ``pool`` on ``stream``; ``replay()`` runs it."""

    def __init__(self, body, pool, stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(stream.device), torch.cuda.graph(self.graph, pool=pool, stream=stream):
            body()  # (torch.cuda.graph synchronizes the current device first: the stream's, here)

    def replay(self) -> None:
        self.graph.replay()


new_graph = CudaGraph  # the CPU tests put a stand-in here that runs ``body`` again on each replay
TENSOR = object()  # stands for a tensor in the leaves a graph or an autograd context keeps


class CaptureError(Exception):
    """The layer cannot be captured (the message says why); it runs eagerly."""


def tensors(leaves) -> list:
    return [t for t in leaves if isinstance(t, torch.Tensor)]


class Graphs:
    """One layer's two graphs for one signature."""

    def __init__(self, statics, params, ident, out_leaves, out_spec, diff_out, diff_in, used) -> None:
        self.statics, self.params, self.identity = statics, params, ident  # identity: policy.identity
        self.out_leaves, self.out_spec = out_leaves, out_spec  # outputs' leaves (TENSOR for tensors), structure
        self.diff_out = diff_out  # indices of the tensor outputs that carry gradients
        self.diff_in = diff_in  # indices of the tensor inputs that require grad
        self.used = used  # per (diff input, then trainable parameter): whether it gets a gradient
        self.forward = self.backward = None
        self.uses = 0  # replays of the forward graph


@contextlib.contextmanager
def _aliased(module, aliases: dict):
    """The module's trainable parameters replaced by ``aliases`` (id -> a new leaf on the same storage)."""
    slots = [(m, n, p) for m in module.modules() for n, p in m._parameters.items() if id(p) in aliases]
    try:
        for m, n, p in slots:
            m._parameters[n] = aliases[id(p)]
        yield
    finally:
        for m, n, p in slots:
            m._parameters[n] = p


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off: collected mid-capture, a dropped model's CUDA graphs would be
    destroyed inside the capture, which CUDA refuses, and the capture fails (torch 2.11 no longer collects
    before a capture). The garbage goes at the next collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture(module, target, spec, leaves, statics, device) -> Graphs:
    """Warm the layer up on the side stream, then capture its two graphs (see the module docstring).
    ``ValueError`` if it draws random numbers; ``CaptureError`` if it cannot be captured."""
    params = [p for p in module.parameters() if p.requires_grad]
    ident = identity(module)
    pool, stream = memory.pool_and_stream(device)
    inputs = tensors(statics.inputs)
    diff_in = [i for i, t in enumerate(inputs) if t.requires_grad]
    # The captures differentiate aliases of the parameters: a parameter's own gradient accumulator may be
    # alive from an earlier step, tied to the default stream, which a capture must not touch.
    aliases = {id(p): torch.nn.Parameter(p.detach()) for p in params}
    wrt = [inputs[i] for i in diff_in] + [aliases[id(p)] for p in params]
    statics.load(leaves)
    # what the calls below start from: no tensor of this call is kept alive, infos become views of the static
    template = [TENSOR if isinstance(t, torch.Tensor) else t for t in statics.call_leaves(leaves)]

    def call():
        args, kwargs = pytree.tree_unflatten(statics.call_leaves(template), spec)
        with _aliased(module, aliases):
            return target(*args, **kwargs)

    rng = _rng_state(device)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))
    versions = [t._version for t in inputs]
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            with memory.allocating_to_pool(device, pool):
                with torch.no_grad():
                    out_leaves, out_spec = pytree.tree_flatten(call())
                out_leaves = [TENSOR if isinstance(o, torch.Tensor) else o for o in out_leaves]  # frees them
                if versions != [t._version for t in inputs]:  # a replay would leave its static inputs changed
                    statics.forget()
                    raise CaptureError("it modifies its tensor arguments in place")
                with torch.enable_grad():
                    outs = tensors(pytree.tree_flatten(call())[0])
                    diff_out = [i for i, o in enumerate(outs) if o.requires_grad]
                    if not diff_out:
                        raise CaptureError("no output of it carries a gradient")
                    grads = torch.autograd.grad(
                        [outs[i] for i in diff_out],
                        wrt,
                        [torch.ones_like(outs[i]) for i in diff_out],
                        allow_unused=True,
                    )
                    used = [g is not None for g in grads]
                    del grads
                shapes = [(o.shape, o.dtype) for o in outs]
                outs = [torch.empty(o.shape, dtype=o.dtype, device="meta") for o in outs]  # shapes, no memory
    finally:
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
    if not torch.equal(rng, _rng_state(device)):
        raise ValueError(
            f"{type(module).__name__} draws random numbers (dropout?): a CUDA graph's recompute would draw other "
            "ones than its forward. Set dropout to 0, or train without graphs"
        )
    if statics.out is None:  # allocated on the current stream, which reads them
        statics.outputs(outs, diff_out, inputs, diff_in, params)
        if statics.epoch != memory.epoch(device):  # an output buffer grew: the pool is a new one
            pool, stream = memory.pool_and_stream(device)
            statics.epoch = memory.epoch(device)
    elif shapes != [(o.shape, o.dtype) for o in statics.out] or len(diff_out) != len(statics.grad_out):
        raise CaptureError("layers of one signature return different outputs")
    del outs
    graphs = Graphs(statics, params, ident, out_leaves, out_spec, diff_out, diff_in, used)

    def forward_body():
        with torch.no_grad():
            for buf, o in zip(statics.out, tensors(pytree.tree_flatten(call())[0])):
                buf.copy_(o)

    def backward_body():
        with torch.enable_grad():
            outs = tensors(pytree.tree_flatten(call())[0])
            grads = torch.autograd.grad([outs[i] for i in diff_out], wrt, statics.grad_out, allow_unused=True)
        del outs
        with torch.no_grad():
            for buf, g in zip(statics.grad_in + statics.grad_params, grads):
                if g is not None:
                    buf.copy_(g)

    try:
        with _collector_paused():
            graphs.forward = new_graph(forward_body, pool, stream)
            graphs.backward = new_graph(backward_body, pool, stream)
    except Exception as e:  # a sync or host-side work that a graph cannot hold
        memory.forget_pool(device)  # torch leaves the allocator recording into the failed capture's pool
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CaptureError(f"{type(e).__name__}: {first}") from e
    return graphs


class Replay(torch.autograd.Function):
    """Forward: load the static inputs, replay the forward graph, copy the outputs out, offload the first
    tensor. Backward: reload it, load again, replay the recompute + backward graph, hand the gradients out."""

    @staticmethod
    def forward(ctx, graphs, leaves, offload_config, *inputs_and_params):
        statics = graphs.statics
        statics.load(leaves)
        graphs.forward.replay()
        outs = [buf.clone() for buf in statics.out]  # the next replay overwrites the static ones
        inputs = inputs_and_params[: len(inputs_and_params) - len(graphs.params)]
        offloader = offloader_for(inputs[0], offload_config)
        ctx.offloaded = OffloadedInput(inputs[0], offloader) if offloader is not None else None
        ctx.save_for_backward(*(inputs[1:] if offloader is not None else inputs))
        ctx.graphs = graphs
        ctx.leaves = [TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        graphs = ctx.graphs
        statics = graphs.statics
        inputs = ([ctx.offloaded.unpack()] if ctx.offloaded is not None else []) + list(ctx.saved_tensors)
        it = iter(inputs)
        statics.load([next(it) if t is TENSOR else t for t in ctx.leaves])
        with torch.no_grad():
            for buf, i in zip(statics.grad_out, graphs.diff_out):
                buf.copy_(grads[i])
        graphs.backward.replay()
        grad_inputs = [None] * len(inputs)
        del inputs, it
        for k, i in enumerate(graphs.diff_in):
            if graphs.used[k]:
                grad_inputs[i] = statics.grad_in[k].clone()  # the next layer's replay overwrites the static one
        # AccumulateGrad copies (or adds) a gradient that someone else references, before the next node of
        # the backward runs (it goes first): the static buffers can be handed out as they are
        used = graphs.used[len(graphs.diff_in) :]
        grad_params = [g if u else None for g, u in zip(statics.grad_params, used)]
        return (None, None, None, *grad_inputs, *grad_params)
