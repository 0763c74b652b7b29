"""``custom_op``: ``torch.library.custom_op`` for fastft's ops, with cheaper eager calls.

torch.compile and export trace the registered op (``fn.op``), and so do calls under a dispatch mode
(``fastft.selective_checkpoint`` saves some ops' results whole). Eager calls skip the dispatcher's per-call host
cost, which is most of a cached per-layer lookup's budget: a call autograd need not record runs the
implementation directly, and one it must record (an op with a registered backward, grad mode on and a tensor
argument that requires grad) runs it through a plain ``torch.autograd.Function`` holding the same setup and
backward, not through the op's generated one (its argument handling costs the host about as much again as the
kernel launches of a small op). That function's backward is once differentiable, as the op's is: its backward
ops have no formula of their own.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def _function(name: str, fn, setup_context, backward) -> type[torch.autograd.Function]:
    # forward takes ctx: a Function with a setup_context staticmethod binds its arguments through
    # inspect.signature on every apply (the host time this path is for), to serve functorch's transforms, which
    # fastft's public ops do not support either way.
    def forward(ctx, *args):
        output = fn(*args)
        setup_context(ctx, args, output)
        return output

    @torch.autograd.function.once_differentiable
    def backward_(ctx, *grads):
        return backward(ctx, *grads)

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward_)}
    return type(name, (torch.autograd.Function,), methods)


def custom_op(name: str):
    def wrap(fn):
        op = torch.library.custom_op(name, fn, mutates_args=())
        parameters = list(inspect.signature(fn).parameters.values())
        defaults = tuple(p.default for p in parameters)
        function = [None]  # the plain autograd.Function, once a backward is registered

        @functools.wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
                return op(*args)
            if function[0] is not None and torch.is_grad_enabled():
                flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))]
                if any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
                    if len(flat) != len(args):
                        return op(*args)  # tensor lists: the op's autograd tracks them
                    return function[0].apply(*args, *defaults[len(args) :])
            return fn(*args)

        def register_autograd(backward, *, setup_context):
            op.register_autograd(backward, setup_context=setup_context)
            function[0] = _function(name.replace("::", "_"), fn, setup_context, backward)

        call.op = op
        call.register_fake = op.register_fake
        call.register_autograd = register_autograd
        return call

    return wrap
