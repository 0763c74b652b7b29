"""Token mixers besides attention in packed batches: the guard that refuses what fastft cannot make
packing-correct, and fastft's ops in the mixers it can.

- ``packing_blockers(model)`` finds the layers that mix tokens along the sequence outside attention from
  independent signs, so that a family missing from any list is still caught: the config's ``layer_types``
  (anything but attention and per-token MLP kinds), the modules (a convolution wider than one token, the
  decay parameters of state-space and delta-rule layers), the names of the model type and of the modules'
  classes (read without the family's prefix); and a decoder stack whose forward takes no ``position_ids``
  (its positions would run on across documents). ``check_packing(model)`` raises a ``ValueError`` naming
  those fastft does not support.
- Supported: Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid) and LFM2's short convolutions.
  ``use_packed_mixers(model)`` replaces the functions their modeling module calls, ``causal_conv1d_fn`` and
  ``torch_chunk_gated_delta_rule``, by ``fastft.packed_conv1d`` and ``fastft.gated_delta_rule`` fed the
  batch's ``PackedSeqInfo`` (which the decoder stack's pre-hook hands every layer); a call without it
  (generation with a cache, another model of the family) runs transformers' function unchanged. A mixer
  class is supported only if its source still makes those calls the way fastft reads them.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys

import torch

from ...conv import packed_conv1d
from ...delta_rule import gated_delta_rule
from ...packing import PackedSeqInfo
from ..models import PACKED_INFO_KWARG, decoder_stack, model_state, transformers_model

# layer_types fastft makes packing-correct: attention through the registry, per-token MLP kinds, and the
# kinds of the mixers below (which ``check_packing`` then finds module by module)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
MLP_LAYER_TYPES = frozenset({"dense", "sparse", "moe", "mlp", "hash_moe"})
MIXER_LAYER_TYPES = frozenset({"linear_attention", "conv"})
# parameters only recurrent mixers hold: Mamba/Mamba-2 and Gated DeltaNet decays, RWKV's time decay
STATE_PARAMETERS = frozenset({"A_log", "dt_bias", "time_decay", "time_faaaa", "time_first"})
MIXER_NAMES = re.compile(
    r"mamba|mixer|deltanet|delta_net|linearattention|linear_attention|lightning|shortconv|short_conv|recurrent|rglru"
    r"|rwkv|lstm|ssm|retention|hyena",
    re.IGNORECASE,
)
WHAT_TO_DO = (
    "fastft cannot keep documents apart there yet, so packed training would carry state or positions from one "
    "document into the next: train without packing (apply(model, packing=False) and padded batches), or a model "
    "whose layers fastft supports (attention, Gated DeltaNet, LFM2's short convolutions)"
)

CONV_FN = "causal_conv1d_fn"
DELTA_RULE_FN = "torch_chunk_gated_delta_rule"
# mixer class -> (the functions of its modeling module fastft replaces, the source each call must have)
SUPPORTED = {
    "Qwen3_5GatedDeltaNet": (CONV_FN, DELTA_RULE_FN),
    "Qwen3_5MoeGatedDeltaNet": (CONV_FN, DELTA_RULE_FN),
    "Qwen3NextGatedDeltaNet": (CONV_FN, DELTA_RULE_FN),
    "OlmoHybridGatedDeltaNet": (CONV_FN, DELTA_RULE_FN),
    "Lfm2ShortConv": (CONV_FN,),
    "Lfm2MoeShortConv": (CONV_FN,),
}
# the calls' text in the mixer's forward: the batch's info reaches them through **kwargs, or LFM2's seq_idx
CALLS = {
    CONV_FN: re.compile(r"causal_conv1d_fn\((?:[^()]|\([^()]*\))*(\*\*kwargs|seq_idx=seq_idx)"),
    DELTA_RULE_FN: re.compile(r"torch_chunk_gated_delta_rule\((?:[^()]|\([^()]*\))*\*\*kwargs"),
}


@dataclasses.dataclass(frozen=True)
class Blocker:
    """A module (or config entry) that mixes tokens in a way fastft's packing does not cover."""

    where: str  # the module's qualified name in the language model, or the config field
    kind: str  # the module's class name, or the layer type
    why: str  # the sign that found it


# ---- the guard ---------------------------------------------------------------------------------------------


def _text_config(model):
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def _language_model(model) -> torch.nn.Module:
    """The text decoder: a multimodal model's vision or audio towers never see the packed text tokens."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def _config_blockers(model) -> list[Blocker]:
    config = _text_config(model)
    found = []
    model_type = getattr(config, "model_type", None) or ""
    if MIXER_NAMES.search(model_type):
        found.append(Blocker("config.model_type", model_type, f"a recurrent family ({model_type!r})"))
    for name in ("layer_types", "layers_block_type", "mlp_layer_types"):
        kinds = getattr(config, name, None)
        if isinstance(kinds, (list, tuple)):
            for kind in dict.fromkeys(k for k in kinds if isinstance(k, str)):
                if kind not in ATTENTION_LAYER_TYPES | MLP_LAYER_TYPES | MIXER_LAYER_TYPES:
                    found.append(Blocker(f"config.{name}", kind, f"layer type {kind!r}"))
    pattern = getattr(config, "hybrid_override_pattern", None)  # Nemotron-H: M = Mamba-2, * = attention
    if isinstance(pattern, str) and "M" in pattern:
        found.append(Blocker("config.hybrid_override_pattern", pattern, "Mamba-2 layers ('M')"))
    return found


def _signs(module: torch.nn.Module) -> list[str]:
    signs = []
    if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
        signs.append(f"a convolution of width {module.kernel_size[0]} along the sequence")
    state = sorted(STATE_PARAMETERS.intersection(n for n, _ in module.named_parameters(recurse=False)))
    if state:
        signs.append(f"recurrent-state parameters {', '.join(state)}")
    return signs


def _owns_weights(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        isinstance(m, torch.nn.Linear) for m in module.children()
    )


def _family_prefix(model) -> str:
    """The family's prefix of class names (``Qwen3_5`` of ``Qwen3_5ForCausalLM``), which may itself name a
    mixer (``Mamba2``, ``xLSTM``): module class names are read without it."""
    match = re.match(r"(.+?)(For[A-Z]\w*|Model)$", type(model).__name__)
    return match.group(1) if match else type(model).__name__


def _module_blockers(model) -> list[Blocker]:
    found, claimed = [], []
    prefix = _family_prefix(model)
    for name, module in _language_model(model).named_modules():
        if any(name.startswith(p + ".") for p in claimed):
            continue  # inside a mixer already found
        signs = _signs(module)
        convs = [(n, m) for n, m in module.named_children() if isinstance(m, torch.nn.Conv1d) and _signs(m)]
        if not signs and convs and not isinstance(module, torch.nn.ModuleList):  # a convolution: its mixer
            signs = [f"holds {type(m).__name__} {n!r}: {', '.join(_signs(m))}" for n, m in convs]
        own_name = type(module).__name__.removeprefix(prefix)
        if not signs and name and MIXER_NAMES.search(own_name) and _owns_weights(module):
            signs = [f"class name {type(module).__name__!r}"]
        if signs:
            found.append(Blocker(name or "(model)", type(module).__name__, "; ".join(signs)))
            claimed.append(name)
    return found


def supported(module: torch.nn.Module) -> bool:
    """Whether fastft makes ``module`` (a mixer ``packing_blockers`` finds) packing-correct: a class of
    ``SUPPORTED`` whose modeling module defines the functions fastft replaces and whose forward calls them
    with the batch's keyword arguments."""
    names = SUPPORTED.get(type(module).__name__)
    namespace = sys.modules.get(type(module).__module__)
    if names is None or namespace is None or not all(callable(getattr(namespace, n, None)) for n in names):
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return all(CALLS[n].search(source) for n in names)


def packing_blockers(model) -> list[Blocker]:
    """The layers of ``model`` (a transformers model, or a PEFT wrapper's) whose token mixing fastft does not
    make packing-correct; empty when only attention and supported mixers mix tokens."""
    inner = transformers_model(model)
    modules = dict(_language_model(inner).named_modules())
    blockers = _config_blockers(inner)
    stack = decoder_stack(inner)
    if "position_ids" not in inspect.signature(stack.forward).parameters:  # e.g. BART's decoder as a causal LM
        why = "its forward takes no position_ids: positions run on across documents"
        blockers.append(Blocker("decoder stack", type(stack).__name__, why))
    for blocker in _module_blockers(inner):
        module = modules.get(blocker.where)
        if module is None or not supported(module):
            blockers.append(blocker)
    return blockers


def check_packing(model) -> None:
    """``ValueError`` naming the layers ``packing_blockers`` finds, and what to do, if there are any."""
    blockers = packing_blockers(model)
    if not blockers:
        return
    kinds = ", ".join(dict.fromkeys(b.kind for b in blockers))
    shown = "; ".join(f"{b.where} ({b.kind}: {b.why})" for b in blockers[:4])
    more = f"; and {len(blockers) - 4} more" if len(blockers) > 4 else ""
    name = type(transformers_model(model)).__name__
    raise ValueError(f"{name} has layers fastft cannot make packing-correct ({kinds}): {shown}{more}. {WHAT_TO_DO}")


# ---- fastft's ops in the supported mixers --------------------------------------------------------------------


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
        info = kwargs.get(PACKED_INFO_KWARG)
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
    def torch_chunk_gated_delta_rule(
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
        """transformers' ``torch_chunk_gated_delta_rule`` with the state reset at every document of the
        batch's ``PackedSeqInfo`` (``fastft.gated_delta_rule``); transformers' own without one."""
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

    torch_chunk_gated_delta_rule.__wrapped__ = original
    return torch_chunk_gated_delta_rule


REPLACEMENTS = {CONV_FN: _conv_fn, DELTA_RULE_FN: _delta_rule_fn}
_patched: dict = {}  # (modeling module name, function name) -> _Patch


@dataclasses.dataclass
class _Patch:
    original: object  # the module's function that fastft's wraps
    models: int  # live models using fastft's
    replacement: object  # fastft's function, as set on the module


def _replace(namespace, name: str):
    key = (namespace.__name__, name)
    patch = _patched.setdefault(key, _Patch(None, 0, None))
    current = getattr(namespace, name)
    if current is not patch.replacement:  # first use, or the module's function was set anew since (a reload)
        patch.original, patch.replacement = current, REPLACEMENTS[name](current)
        setattr(namespace, name, patch.replacement)
    patch.models += 1

    def restore():
        patch.models -= 1
        if patch.models == 0:
            _patched.pop(key)
            if getattr(namespace, name) is patch.replacement:
                setattr(namespace, name, patch.original)

    return restore


def _prepare_mixers(module, args, kwargs):
    """Decoder-stack pre-hook after the attention's: LFM2's convolutions get the batch's info as ``seq_idx``;
    a packed batch builds no recurrent cache (its state would mix the documents)."""
    info = kwargs.get(PACKED_INFO_KWARG)
    if info is None:
        return args, kwargs
    return args, {**kwargs, "seq_idx": info, "use_cache": False}


def use_packed_mixers(model):
    """fastft's packed ops in every supported mixer of ``model`` (after ``check_packing``); returns the model.
    Recorded once per model; ``revert`` restores transformers' functions once no model uses fastft's."""
    inner = transformers_model(model)
    state = model_state(inner)
    if "mixers" in state.records:
        return model
    mixers = [m for m in _language_model(inner).modules() if type(m).__name__ in SUPPORTED and supported(m)]
    if not mixers:
        return model
    namespaces = {type(m).__module__: SUPPORTED[type(m).__name__] for m in mixers}
    restores = [_replace(sys.modules[mod], name) for mod, names in namespaces.items() for name in names]
    hook = decoder_stack(model).register_forward_pre_hook(_prepare_mixers, with_kwargs=True)

    def undo():
        hook.remove()
        for restore in restores:
            restore()

    state.add("mixers", sorted({type(m).__name__ for m in mixers}), undo)
    return model
