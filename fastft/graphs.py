"""CUDA graphs for checkpointed layers: a layer's forward, and its recompute + backward, one replay each.

    y = fastft.graphed_checkpoint(layer, x, **kwargs)
    # fastft.offloaded_checkpoint(layer, x, **kwargs) in values and gradients, in a few launches per layer

``layer`` is an ``nn.Module``, or a bound method or ``functools.partial`` of one (what transformers hands
its checkpoint function). The first call with a new *signature* (the tensors' shapes, dtypes, devices and
``requires_grad``; the other arguments' values; the layer's mode, trainable parameters and autocast) runs
the layer once without and once with grad on a side stream (Triton compiles, cuBLAS workspaces), then
captures two CUDA graphs into a memory pool that every layer shares: the forward without grad, and the
recompute with ``torch.autograd.grad`` of the outputs with respect to the inputs that require grad and the
layer's trainable parameters. Each call copies its tensors into static buffers, which the layers of one
signature share (an argument that is the unchanged tensor last copied, such as the rotary tables every
layer gets, is not copied again), replays, and copies the outputs out. The first tensor argument is
offloaded as ``offloaded_checkpoint`` does (``offload_config``). Parameter gradients go through autograd,
so DDP's hooks and hooks on parameters run as usual.

A ``PackedSeqInfo`` argument reaches the graph padded (``PackedSeqInfo.padded``): its sequence count and
longest sequence rounded up to powers of two, so one graph serves the batches of one packed length whose
documents fall in the same buckets. Pad packs to a few lengths: each new signature costs a capture.

A layer that draws random numbers (dropout) is refused with ``ValueError``: the replayed recompute would
draw other ones than the forward. ``offloaded_checkpoint`` runs the call instead, with a warning once per
layer and reason, when the capture fails (a host sync or host-dependent work inside the layer), when the
layer modifies its tensor arguments in place, when it or a submodule has module hooks (a replay would not
run them), when an argument is neither a tensor, a ``PackedSeqInfo`` nor hashable, past
``MAX_SIGNATURES`` signatures of a layer, and with ``context_fn`` or ``debug``; and silently where no graph
applies: grad disabled, no tensor argument, tensors off the GPU, nothing that requires grad.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
import weakref

import torch
from torch.utils import _pytree as pytree

from .offload import OffloadConfig, OffloadedInput, offloaded_checkpoint, offloader_for
from .packing import PackedSeqInfo

MAX_SIGNATURES = 8  # graphs kept per layer; later signatures run eagerly
GRAPH_DEVICES = ("cuda",)
_STATE = "_fastft_graphs"  # in a graphed layer's __dict__: its LayerGraphs


def bucket(n: int, limit: int) -> int:
    """``n`` rounded up to a power of two, but not past ``limit`` (nor below ``n``)."""
    return max(n, min(1 << max(n - 1, 0).bit_length(), limit))


class CudaGraph:
    """``body()`` captured as one CUDA graph into ``pool`` on ``stream``; ``replay()`` runs it."""

    def __init__(self, body, pool, stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            body()

    def replay(self) -> None:
        self.graph.replay()


new_graph = CudaGraph  # the CPU tests put a stand-in here that runs ``body`` again on each replay
_pools: dict = {}
_streams: dict = {}


def _pool_and_stream(device: torch.device):
    if device.type != "cuda":
        return None, None
    if device not in _pools:
        _pools[device] = torch.cuda.graph_pool_handle()
        _streams[device] = torch.cuda.Stream(device)
    return _pools[device], _streams[device]


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _describe(leaf):
    """A hashable description of one argument for the signature; ``TypeError`` if there is none."""
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    if isinstance(leaf, PackedSeqInfo):
        t = leaf.num_tokens
        return ("info", t, leaf.shape, leaf.device, bucket(leaf.num_seqs, t), bucket(leaf.max_seqlen, t))
    hash(leaf)
    return ("value", type(leaf), leaf)


def _identity(module: torch.nn.Module) -> tuple:
    """What a captured graph reads of the layer: where each parameter and buffer lives, which train."""
    return tuple((t.data_ptr(), t.requires_grad) for t in itertools.chain(module.parameters(), module.buffers()))


class _Statics:
    """The static buffers of one signature, shared by its layers' graphs, and what was last copied in."""

    def __init__(self, leaves, descs) -> None:
        self.inputs = []
        for leaf, desc in zip(leaves, descs):
            if isinstance(leaf, torch.Tensor):
                self.inputs.append(torch.empty_like(leaf).requires_grad_(leaf.requires_grad))
            elif isinstance(leaf, PackedSeqInfo):
                self.inputs.append(torch.empty(desc[4] + 1, dtype=torch.int32, device=leaf.device))
            else:
                self.inputs.append(None)
        self.descs = descs
        self.last = [None] * len(leaves)  # (weakref to the source, its version) per input
        self.out = self.grad_out = self.grad_in = self.grad_params = None  # set by the first capture

    def load(self, leaves) -> None:
        """Copy ``leaves`` into the static inputs, but for an unchanged source copied last time."""
        with torch.no_grad():
            for i, (leaf, static) in enumerate(zip(leaves, self.inputs)):
                if static is None:
                    continue
                version = leaf._version if isinstance(leaf, torch.Tensor) else None
                last = self.last[i]
                if last is not None and last[0]() is leaf and last[1] == version:
                    continue
                if isinstance(leaf, torch.Tensor):
                    static.copy_(leaf)
                else:
                    leaf.padded(static.numel() - 1, self.descs[i][5], out=static)
                self.last[i] = (weakref.ref(leaf), version)

    def call_leaves(self, leaves) -> list:
        """The arguments the layer is called with inside a graph: the static inputs, and a fresh info over
        the static ``cu_seqlens`` per call (what the layer derives from it is derived inside the graph; no
        kernel runs to build it)."""
        out = []
        for leaf, static, desc in zip(leaves, self.inputs, self.descs):
            if isinstance(leaf, PackedSeqInfo):
                static = leaf.padded(static.numel() - 1, desc[5], out=static, fill=False)
            out.append(leaf if static is None else static)
        return out


_shared = weakref.WeakValueDictionary()  # (signature, trainable parameters' shapes) -> _Statics


class _Graphs:
    """One layer's two graphs for one signature."""

    def __init__(self, statics, params, identity, out_leaves, out_spec, diff_out, diff_in, used) -> None:
        self.statics, self.params, self.identity = statics, params, identity
        self.out_leaves, self.out_spec = out_leaves, out_spec  # outputs' leaves (_TENSOR for tensors), structure
        self.diff_out = diff_out  # indices of the tensor outputs that carry gradients
        self.diff_in = diff_in  # indices of the tensor inputs that require grad
        self.used = used  # per (diff input, then trainable parameter): whether it gets a gradient
        self.forward = self.backward = None


class LayerGraphs:
    """A graphed layer's graphs by signature, and the reasons it already warned about."""

    def __init__(self) -> None:
        self.graphs: dict = {}
        self.warned: set = set()
        self.off: str | None = None  # why this layer runs eagerly from now on


_TENSOR = object()  # stands for a tensor in the leaves a graph or an autograd context keeps


class _CaptureError(Exception):
    pass


def _tensors(leaves) -> list:
    return [t for t in leaves if isinstance(t, torch.Tensor)]


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


def _capture(module, target, spec, leaves, statics, device) -> _Graphs:
    """Warm the layer up on the side stream, then capture its two graphs (see the module docstring).
    ``ValueError`` if it draws random numbers; ``_CaptureError`` if the capture itself fails."""
    params = [p for p in module.parameters() if p.requires_grad]
    identity = _identity(module)
    pool, stream = _pool_and_stream(device)
    inputs = _tensors(statics.inputs)
    diff_in = [i for i, t in enumerate(inputs) if t.requires_grad]
    # The captures differentiate aliases of the parameters: a parameter's own gradient accumulator may be
    # alive from an earlier step, tied to the default stream, which a capture must not touch.
    aliases = {id(p): torch.nn.Parameter(p.detach()) for p in params}
    wrt = [inputs[i] for i in diff_in] + [aliases[id(p)] for p in params]
    statics.load(leaves)
    # what the calls below start from: no tensor of this call is kept alive, infos become views of the static
    template = [_TENSOR if isinstance(t, torch.Tensor) else t for t in statics.call_leaves(leaves)]

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
            with torch.no_grad():
                out_leaves, out_spec = pytree.tree_flatten(call())
            if versions != [t._version for t in inputs]:  # a replay would leave its static inputs changed
                statics.last = [None] * len(statics.last)
                raise _CaptureError("it modifies its tensor arguments in place")
            with torch.enable_grad():
                outs = _tensors(pytree.tree_flatten(call())[0])
                diff_out = [i for i, o in enumerate(outs) if o.requires_grad]
                if not diff_out:
                    raise _CaptureError("no output of it carries a gradient")
                ones = [torch.ones_like(outs[i]) for i in diff_out]
                grads = torch.autograd.grad([outs[i] for i in diff_out], wrt, ones, allow_unused=True)
                used = [g is not None for g in grads]
                del grads
    finally:
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
    if not torch.equal(rng, _rng_state(device)):
        raise ValueError(
            f"{type(module).__name__} draws random numbers (dropout?): a CUDA graph's recompute would draw other "
            "ones than its forward. Set dropout to 0, or train without graphs"
        )
    if statics.out is None:  # allocated on the current stream, which reads them
        statics.out = [torch.empty_like(o) for o in outs]
        statics.grad_out = [torch.empty_like(outs[i]) for i in diff_out]
        statics.grad_in = [torch.empty_like(inputs[i]) for i in diff_in]
        statics.grad_params = [torch.empty_like(p) for p in params]
    elif [(o.shape, o.dtype) for o in outs] != [(o.shape, o.dtype) for o in statics.out] or len(diff_out) != len(
        statics.grad_out
    ):
        raise _CaptureError("layers of one signature return different outputs")
    del outs, ones
    out_leaves = [_TENSOR if isinstance(o, torch.Tensor) else o for o in out_leaves]
    graphs = _Graphs(statics, params, identity, out_leaves, out_spec, diff_out, diff_in, used)

    def forward_body():
        with torch.no_grad():
            for buf, o in zip(statics.out, _tensors(pytree.tree_flatten(call())[0])):
                buf.copy_(o)

    def backward_body():
        with torch.enable_grad():
            outs = _tensors(pytree.tree_flatten(call())[0])
            grads = torch.autograd.grad([outs[i] for i in diff_out], wrt, statics.grad_out, allow_unused=True)
        with torch.no_grad():
            for buf, g in zip(statics.grad_in + statics.grad_params, grads):
                if g is not None:
                    buf.copy_(g)

    try:
        graphs.forward = new_graph(forward_body, pool, stream)
        graphs.backward = new_graph(backward_body, pool, stream)
    except Exception as e:  # a sync or host-side work that a graph cannot hold
        # torch leaves the allocator recording into the pool of a failed capture: later captures take new ones
        _pools.pop(device, None)
        _streams.pop(device, None)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _CaptureError(f"{type(e).__name__}: {first}") from e
    return graphs


class _Replay(torch.autograd.Function):
    """Forward: load the static inputs, replay the forward graph, copy the outputs out, offload the first
    tensor. Backward: reload it, load again, replay the recompute + backward graph, hand the gradients out."""

    @staticmethod
    def forward(ctx, graphs, leaves, offload_config, *tensors):
        statics = graphs.statics
        statics.load(leaves)
        graphs.forward.replay()
        outs = [buf.clone() for buf in statics.out]  # the next replay overwrites the static ones
        inputs = tensors[: len(tensors) - len(graphs.params)]
        offloader = offloader_for(inputs[0], offload_config)
        ctx.offloaded = OffloadedInput(inputs[0], offloader) if offloader is not None else None
        ctx.save_for_backward(*(inputs[1:] if offloader is not None else inputs))
        ctx.graphs = graphs
        ctx.leaves = [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        graphs = ctx.graphs
        statics = graphs.statics
        inputs = ([ctx.offloaded.unpack()] if ctx.offloaded is not None else []) + list(ctx.saved_tensors)
        it = iter(inputs)
        statics.load([next(it) if t is _TENSOR else t for t in ctx.leaves])
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


def _module_call(function, args, kwargs):
    """(module, callable, positional args, keyword args) of ``function(*args, **kwargs)``."""
    target, pre_args, pre_kwargs = function, (), {}
    if isinstance(function, functools.partial):
        target, pre_args, pre_kwargs = function.func, function.args, function.keywords
    module = target if isinstance(target, torch.nn.Module) else getattr(target, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            "graphed_checkpoint needs a module call (an nn.Module, a bound method of one, or a functools.partial "
            f"of either): its trainable parameters get their gradients from the graph; got {type(function).__name__}"
        )
    return module, target, (*pre_args, *args), {**pre_kwargs, **kwargs}


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
    **kwargs,
):
    """``fastft.offloaded_checkpoint(function, *args, **kwargs)`` replayed as CUDA graphs (see the module
    docstring); the same options, which the eager fallback takes. ``function`` must be a module call."""
    if use_reentrant:
        raise ValueError("graphed_checkpoint is non-reentrant; use_reentrant must be False or None")
    if offload_config is not None and not isinstance(offload_config, OffloadConfig):
        raise TypeError(f"offload_config must be a fastft.OffloadConfig or None, got {type(offload_config).__name__}")
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
    if not any(t.requires_grad for t in itertools.chain(_tensors(leaves), module.parameters())):
        return eager()  # no gradient to compute
    state = module.__dict__.get(_STATE)
    if state is None:
        state = module.__dict__[_STATE] = LayerGraphs()
    why = state.off or ("context_fn is given" if context_fn is not None else "debug=True" if debug else None)
    if why is None and _hooked(module):
        why = "it (or a submodule) has forward or backward hooks, which a replay would not run"
    if why is None:
        try:
            descs = tuple(_describe(t) for t in leaves)
        except TypeError:
            kinds = {type(t).__name__ for t in leaves if not isinstance(t, (torch.Tensor, PackedSeqInfo))}
            why = f"an argument is neither a tensor, a PackedSeqInfo nor hashable ({', '.join(sorted(kinds))})"
    if why is not None:
        _warn(state, module, why)
        return eager()
    autocast = torch.is_autocast_enabled(x.device.type)
    key = (spec, descs, module.training, autocast, torch.get_autocast_dtype(x.device.type) if autocast else None)
    graphs = state.graphs.get(key)
    if graphs is not None and graphs.identity != _identity(module):
        graphs = None  # parameters replaced or requires_grad changed since the capture: capture again
    if graphs is None:
        if key not in state.graphs and len(state.graphs) >= MAX_SIGNATURES:
            _warn(state, module, f"it has had {MAX_SIGNATURES} signatures (pad packs to a few lengths)")
            return eager()
        state.graphs.pop(key, None)
        trainable = tuple((tuple(p.shape), p.dtype) for p in module.parameters() if p.requires_grad)
        shared = (key, type(module), trainable)
        statics = _shared.get(shared)
        if statics is None:
            statics = _shared[shared] = _Statics(leaves, descs)
        try:
            graphs = _capture(module, target, spec, leaves, statics, x.device)
        except _CaptureError as e:
            state.off = f"capturing it failed ({e})"
            _warn(state, module, state.off)
            return eager()
        state.graphs[key] = graphs
    outs = _Replay.apply(graphs, leaves, offload_config, *_tensors(leaves), *graphs.params)
    it = iter(outs)
    return pytree.tree_unflatten([next(it) if o is _TENSOR else o for o in graphs.out_leaves], graphs.out_spec)
