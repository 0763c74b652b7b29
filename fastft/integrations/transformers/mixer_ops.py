"""fastft's ops in place of the functions transformers' token mixers call (``mixers.use_packed_mixers`` puts
them there): each reads the batch's ``PackedSeqInfo`` from the call's keyword arguments (or, for a mixer its
layer calls without them, from the layer: ``LAYER_INFO``) and runs fastft's packed op; a call without one
(generation with a cache, another model of the family) runs transformers' own function unchanged. Decoder
stacks that hand their blocks no keyword arguments (Mamba, Mamba-2, Falcon-Mamba) get the info to their blocks
through ``STACK_INFO`` and ``block_call``."""

from __future__ import annotations

import contextvars
import inspect
import math
import sys

import torch

from ...conv import packed_conv1d
from ...delta_rule import gated_delta_rule
from ...packing import PackedSeqInfo
from ...selective_scan import packed_selective_scan
from ...ssd import packed_ssd_scan
from ..models import PACKED_INFO_KWARG

CONV_FN = "causal_conv1d_fn"
DELTA_RULE_FN = "torch_chunk_gated_delta_rule"
KDA_FN = "chunk_kimi_delta_attention"
SSD_FN = "mamba2_chunk_scan"
FUSED_SSD_FN = "mamba2_split_conv1d_scan_combined"  # mamba_ssm's fused kernel where installed, else None
SELECTIVE_SCAN_FN = "mamba_selective_scan"
INNER_FN = "mamba_inner_fn"  # Mamba-1's fused kernel (mamba_ssm's where installed, else None)
FORWARD = "forward"  # the mixer class's own forward, replaced where no function of its module does the mixing


def _no_cache(initial_state=None, output_final_state=False, cache=None) -> None:
    if initial_state is not None or output_final_state or cache is not None:
        raise ValueError(
            "a packed batch with a recurrent cache: fastft's packed mixers keep no state across batches "
            "(call the model with use_cache=False, as packed training does)"
        )


def _conv_fn(original):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """transformers' ``causal_conv1d_fn`` (``[B, C, T]`` in and out) restarting at every document of the
        batch's ``PackedSeqInfo`` (``fastft.packed_conv1d``); transformers' own without one."""
        info = kwargs.get(PACKED_INFO_KWARG, LAYER_INFO.get())
        if info is None and isinstance(kwargs.get("seq_idx"), PackedSeqInfo):  # LFM2: its only per-batch argument
            info = kwargs["seq_idx"]
        if info is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        if hidden_states.shape[-1] * hidden_states.shape[0] != info.num_tokens:
            _no_cache(cache=True)  # update_conv_state put a cached state before the tokens
        out = packed_conv1d(hidden_states.transpose(1, 2), weight, info, bias=bias, activation=activation)
        return out.transpose(1, 2)

    causal_conv1d_fn.__wrapped__ = original  # inspect.unwrap finds transformers' own
    return causal_conv1d_fn


def _delta_rule_fn(original):
    def delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        """transformers' gated delta rule (``torch_chunk_gated_delta_rule``, a decay per head; or Kimi's
        ``chunk_kimi_delta_attention``, a decay per key channel) with the state reset at every document of the
        batch's ``PackedSeqInfo`` (``fastft.gated_delta_rule`` takes both); transformers' own without one."""
        info = kwargs.get(PACKED_INFO_KWARG)
        if info is None:
            return original(
                query,
                key,
                value,
                g,
                beta,
                chunk_size=chunk_size,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )
        _no_cache(initial_state, output_final_state)
        if key.shape[2] != value.shape[2]:  # fewer key heads than value heads (handed over so from 5.24)
            groups = value.shape[2] // key.shape[2]  # each key head serves that many consecutive value heads
            query, key = query.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)
        out = gated_delta_rule(query, key, value, g, beta, info, use_qk_l2norm=use_qk_l2norm_in_kernel)
        return out, None

    delta_rule.__name__ = delta_rule.__qualname__ = original.__name__
    delta_rule.__wrapped__ = original
    return delta_rule


# The batch's info while a decoder layer of CONTEXT_LAYERS runs (its mixer's calls get no keyword arguments).
LAYER_INFO: contextvars.ContextVar = contextvars.ContextVar("fastft_layer_info", default=None)


def _ssd_fn(original):
    def mamba2_chunk_scan(
        hidden_states,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        dt_bias=None,
        initial_states=None,
        dt_softplus=False,
        dt_limit=(0.0, math.inf),
        return_final_states=False,
        **kwargs,
    ):
        """transformers' ``mamba2_chunk_scan`` (Mamba-2) with the state reset at every document of the batch's
        ``PackedSeqInfo`` (``fastft.packed_ssd_scan``); transformers' own without one."""
        info = kwargs.get(PACKED_INFO_KWARG)
        if info is None:
            return original(
                hidden_states,
                dt,
                A,
                B,
                C,
                chunk_size,
                D=D,
                dt_bias=dt_bias,
                initial_states=initial_states,
                dt_softplus=dt_softplus,
                dt_limit=dt_limit,
                return_final_states=return_final_states,
                **kwargs,
            )
        _no_cache(initial_states, return_final_states)
        return packed_ssd_scan(
            hidden_states, dt, A, B, C, info, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
            z=kwargs.get("z"),
        )  # fmt: skip

    mamba2_chunk_scan.__wrapped__ = original
    return mamba2_chunk_scan


def _fused_ssd_fn(original):
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        """None (the mixer then takes its unfused path, whose convolution and scan fastft replaces) in a packed
        batch; transformers' own (mamba_ssm's fused kernel where installed, else None) otherwise."""
        if kwargs.get(PACKED_INFO_KWARG) is not None:
            return None
        return original(*args, **kwargs)

    mamba2_split_conv1d_scan_combined.__wrapped__ = original
    return mamba2_split_conv1d_scan_combined


def _inner_fn(original):
    def mamba_inner_fn(*args, **kwargs):
        """None (the mixer then takes its unfused path, whose convolution and scan fastft replaces) in a packed
        batch; transformers' own (mamba_ssm's fused kernel where installed, else None) otherwise."""
        if kwargs.get(PACKED_INFO_KWARG, LAYER_INFO.get()) is not None:
            return None
        return original(*args, **kwargs)

    mamba_inner_fn.__wrapped__ = original
    return mamba_inner_fn


def _selective_scan_fn(original):
    def mamba_selective_scan(
        hidden_states,
        dt,
        A,
        B,
        C,
        D=None,
        z=None,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=False,
        use_mambapy=False,
        use_associative_scan=False,
        **kwargs,
    ):
        """transformers' ``mamba_selective_scan`` (Mamba-1) with the state reset at every document of the batch's
        ``PackedSeqInfo`` (``fastft.packed_selective_scan``); transformers' own without one."""
        info = kwargs.get(PACKED_INFO_KWARG, LAYER_INFO.get())
        if info is None:
            return original(
                hidden_states,
                dt,
                A,
                B,
                C,
                D=D,
                z=z,
                delta_bias=delta_bias,
                delta_softplus=delta_softplus,
                return_last_state=return_last_state,
                use_mambapy=use_mambapy,
                use_associative_scan=use_associative_scan,
                **kwargs,
            )
        _no_cache(output_final_state=return_last_state)
        return packed_selective_scan(
            hidden_states, dt, A, B, C, info, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus
        )

    mamba_selective_scan.__wrapped__ = original
    return mamba_selective_scan


def _layer_forward(original):
    def forward(self, *args, **kwargs):
        """transformers' decoder-layer forward, holding the batch's ``PackedSeqInfo`` (where it has one) for the
        replaced functions its mixer calls without keyword arguments."""
        info = kwargs.get(PACKED_INFO_KWARG)
        if info is None:
            return original(self, *args, **kwargs)
        token = LAYER_INFO.set(info)
        try:
            return original(self, *args, **kwargs)
        finally:
            LAYER_INFO.reset(token)

    forward.__wrapped__ = original
    return forward


# The batch's info while a decoder stack of ``STACKS`` (Mamba, Mamba-2, Falcon-Mamba) runs, and the boundaries
# (position_ids, cu_seq_lens_q, max_length_q) its causal LM was called with: these models hand neither on.
STACK_INFO: contextvars.ContextVar = contextvars.ContextVar("fastft_stack_info", default=None)
CALL_KWARGS: contextvars.ContextVar = contextvars.ContextVar("fastft_call_kwargs", default=None)
BOUNDARY_KWARGS = ("position_ids", "cu_seq_lens_q", "max_length_q")


def block_call(original):
    """A block class's ``__call__`` that passes the block the batch's info (``STACK_INFO``) as a keyword
    argument, before transformers' checkpointing takes the call's arguments: its recomputation in the backward,
    when the stack no longer runs, gets the info too."""

    def __call__(self, *args, **kwargs):
        info = STACK_INFO.get()
        if info is not None and PACKED_INFO_KWARG not in kwargs:
            kwargs[PACKED_INFO_KWARG] = info
        return original(self, *args, **kwargs)

    __call__.__wrapped__ = original
    return __call__


def _lightning_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        """MiniMax's lightning attention (linear attention with a decay per head, Mamba-2's scan with dt = 1,
        A = -slope, B = keys, C = queries, x = values) with the state reset at every document of the batch's
        ``PackedSeqInfo`` (``fastft.packed_ssd_scan``); transformers' own forward without one."""
        info = kwargs.get(PACKED_INFO_KWARG)
        if info is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        _no_cache(cache=bound.get("past_key_values", bound.get("cache")))
        hidden_states = bound["hidden_states"]
        batch_size, seq_len, _ = hidden_states.shape
        heads = self.num_attention_heads
        qkv_states = self.act_fn(self.qkv_proj(hidden_states))
        qkv_states = sys.modules[type(self).__module__].apply_mask_to_padding_states(
            qkv_states, bound.get("attention_mask")
        )
        qkv_states = qkv_states.reshape(batch_size, seq_len, heads, 3 * self.head_dim)
        query_states, key_states, value_states = torch.split(qkv_states, self.head_dim, dim=3)
        steps = value_states.new_ones(batch_size, seq_len, heads)
        decay_rate = -self.slope_rate.reshape(heads)
        attn_output = packed_ssd_scan(value_states, steps, decay_rate, key_states, query_states, info)
        attn_output = attn_output.reshape(batch_size, seq_len, heads * self.head_dim)
        attn_output = self.norm(attn_output)
        attn_output = torch.sigmoid(self.output_gate(hidden_states)) * attn_output
        return self.out_proj(attn_output), None

    forward.__wrapped__ = original
    return forward


REPLACEMENTS = {
    CONV_FN: _conv_fn,
    DELTA_RULE_FN: _delta_rule_fn,
    KDA_FN: _delta_rule_fn,
    SSD_FN: _ssd_fn,
    FUSED_SSD_FN: _fused_ssd_fn,
    SELECTIVE_SCAN_FN: _selective_scan_fn,
    INNER_FN: _inner_fn,
}
FORWARDS = {
    "MiniMaxLightningAttention": _lightning_forward,
    "JambaMambaDecoderLayer": _layer_forward,
    "MambaBlock": _layer_forward,
    "FalconMambaBlock": _layer_forward,
}
