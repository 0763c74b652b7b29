"""``custom_op``: ``torch.library.custom_op`` for fastft's ops, with a cheaper eager call.

torch.compile and export trace the registered op (``fn.op``); eager calls run the implementation directly,
skipping the dispatcher's per-call host cost, which is most of a cached per-layer lookup's budget. Calls
that autograd must record (an op with a registered backward, grad mode on and a tensor argument that requires
grad) go through the op, and so do calls under a dispatch mode (``fastft.selective_checkpoint`` saves some
ops' results whole).
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def custom_op(name: str):
    def wrap(fn):
        op = torch.library.custom_op(name, fn, mutates_args=())
        differentiable = [False]

        @functools.wraps(fn)
        def call(*args):
            if (
                torch.compiler.is_compiling()
                or _get_current_dispatch_mode() is not None
                or (
                    differentiable[0]
                    and torch.is_grad_enabled()
                    and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                )
            ):
                return op(*args)
            return fn(*args)

        def register_autograd(*args, **kwargs):
            differentiable[0] = True
            op.register_autograd(*args, **kwargs)

        call.op = op
        call.register_fake = op.register_fake
        call.register_autograd = register_autograd
        return call

    return wrap
