"""Token mixers besides attention in packed batches: the guard that refuses what fastft cannot make
packing-correct, and the patching that puts fastft's ops (``mixer_ops``) in the mixers it can.

- ``packing_blockers(model)`` finds the layers that mix tokens along the sequence outside attention from
  independent signs, so that a family missing from any list is still caught: the config's ``layer_types``
  (anything but attention and per-token MLP kinds), the modules (a convolution wider than one token, the
  decay parameters of state-space and delta-rule layers), the names of the model type and of the modules'
  classes (read without the family's prefix); and a decoder stack whose forward takes no ``position_ids``
  (its positions would run on across documents). ``check_packing(model)`` raises a ``ValueError`` naming
  those fastft does not support.
- Supported (``SUPPORTED``): Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid), Kimi Delta
  Attention (Kimi-Linear), Mamba-2 (Bamba, Granite-4.0-H, Falcon-H1, Nemotron-H, Zamba2, Mamba-2), Mamba-1
  (Jamba, Mamba, Falcon-Mamba), MiniMax's lightning attention and LFM2's short convolutions.
  ``use_packed_mixers(model)`` replaces the functions their modeling module calls (``causal_conv1d_fn``,
  ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ...) or, where no function of the module does the
  mixing, the class's forward, by ``mixer_ops``'s, fed the batch's ``PackedSeqInfo`` (which the decoder stack's
  pre-hook hands every layer); a call without it (generation with a cache, another model of the family) runs
  transformers' code unchanged. A mixer class is supported only if its source still makes those calls the way
  fastft reads them.
- The pure Mamba stacks (``STACKS``) pass the batch's keyword arguments neither from their causal LM to the
  stack nor to their blocks: fastft holds them while the model runs and hands each block the info
  (``mixer_ops.block_call``), before transformers' checkpointing takes the block's arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys

import torch

from ..models import PACKED_INFO_KWARG, decoder_stack, model_state, transformers_model
from . import versions
from .mixer_ops import (  # noqa: F401  (the names of the functions fastft replaces, by their modules)
    BOUNDARY_KWARGS,
    CALL_KWARGS,
    CONV_FN,
    DELTA_RULE_FN,
    FORWARD,
    FORWARDS,
    FUSED_SSD_FN,
    INNER_FN,
    KDA_FN,
    REPLACEMENTS,
    SELECTIVE_SCAN_FN,
    SSD_FN,
    STACK_INFO,
    block_call,
)

# layer_types fastft makes packing-correct: attention through the registry, per-token MLP kinds, and the
# kinds of the mixers below (which ``check_packing`` then finds module by module)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
MLP_LAYER_TYPES = frozenset({"dense", "sparse", "moe", "mlp", "hash_moe"})
MIXER_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba", "hybrid"})
# Nemotron-H's hybrid_override_pattern letters: Mamba-2 (module by module, as above), attention, MLP, MoE
HYBRID_PATTERN_LETTERS = frozenset("M*-E")
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
    "whose layers fastft supports (attention, Gated DeltaNet, Kimi Delta Attention, Mamba-2 and Mamba-1, "
    "MiniMax's lightning attention, LFM2's short convolutions)"
)

MAMBA2 = (CONV_FN, FUSED_SSD_FN, SSD_FN)
# mixer class -> the functions of its modeling module fastft replaces (or FORWARD)
SUPPORTED = {
    "Qwen3_5GatedDeltaNet": (CONV_FN, DELTA_RULE_FN),
    "Qwen3_5MoeGatedDeltaNet": (CONV_FN, DELTA_RULE_FN),
    "Qwen3NextGatedDeltaNet": (CONV_FN, DELTA_RULE_FN),
    "OlmoHybridGatedDeltaNet": (CONV_FN, DELTA_RULE_FN),
    "Lfm2ShortConv": (CONV_FN,),
    "Lfm2MoeShortConv": (CONV_FN,),
    "KimiLinearDeltaAttention": (CONV_FN, KDA_FN),
    "BambaMixer": MAMBA2,
    "GraniteMoeHybridMambaLayer": MAMBA2,
    "FalconH1Mixer": MAMBA2,
    "NemotronHMamba2Mixer": MAMBA2,
    "Zamba2MambaMixer": MAMBA2,
    "JambaMambaMixer": (CONV_FN, SELECTIVE_SCAN_FN),
    "MambaMixer": (CONV_FN, SELECTIVE_SCAN_FN, INNER_FN),
    "FalconMambaMixer": (CONV_FN, SELECTIVE_SCAN_FN, INNER_FN),
    "Mamba2Mixer": MAMBA2,
    "MiniMaxLightningAttention": (FORWARD,),
}
# the calls' text in the mixer's forward: the batch's info reaches them through **kwargs, or LFM2's seq_idx, or
# (a mixer of CONTEXT_LAYERS, whose calls get no keyword arguments) the info its decoder layer holds
CALLS = {
    CONV_FN: re.compile(r"causal_conv1d_fn\((?:[^()]|\([^()]*\))*(\*\*kwargs|seq_idx=seq_idx)"),
    DELTA_RULE_FN: re.compile(r"torch_chunk_gated_delta_rule\((?:[^()]|\([^()]*\))*\*\*kwargs"),
    KDA_FN: re.compile(r"chunk_kimi_delta_attention\((?:[^()]|\([^()]*\))*\*\*kwargs"),
    SSD_FN: re.compile(r"mamba2_chunk_scan\((?:[^()]|\([^()]*\))*\*\*kwargs"),
    FUSED_SSD_FN: re.compile(
        r"fused_kwargs = kwargs \|(?s:.)*mamba2_split_conv1d_scan_combined\((?:[^()]|\([^()]*\))*\*\*fused_kwargs"
    ),
    SELECTIVE_SCAN_FN: re.compile(r"mamba_selective_scan\("),
    INNER_FN: re.compile(r"mamba_inner_fn\("),
}
# mixer class -> its decoder layer class (same modeling module), which holds the batch's info while it runs: the
# layer hands the mixer no keyword arguments
CONTEXT_LAYERS = {
    "JambaMambaMixer": ("JambaMambaDecoderLayer", re.compile(r"self\.mamba\(")),
    "MambaMixer": ("MambaBlock", re.compile(r"self\.mixer\(")),
    "FalconMambaMixer": ("FalconMambaBlock", re.compile(r"self\.mixer\(")),
}
# decoder stacks (Mamba, Mamba-2, Falcon-Mamba: no positions) whose causal LM hands them no position_ids and which
# call their blocks without the batch's keyword arguments: stack class -> (its block class, the blocks' call
# in the stack's forward, the stack's call in the causal LM's forward); their model types name a mixer
STACKS = {
    "MambaModel": ("MambaBlock", re.compile(r"mixer_block\("), re.compile(r"self\.backbone\(")),
    "Mamba2Model": ("Mamba2Block", re.compile(r"mixer_block\("), re.compile(r"self\.backbone\(")),
    "FalconMambaModel": ("FalconMambaBlock", re.compile(r"mixer_block\("), re.compile(r"self\.backbone\(")),
}
STACK_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba"})
# calls a supported mixer's forward must not make: fused kernels fastft does not replace (mamba_ssm's, where installed)
# (mamba_inner_fn: only where fastft replaces it, see ``supported``)
UNHANDLED_CALLS = re.compile(r"\b(mamba_split_conv1d_scan_combined|selective_scan_fn)\(")
# classes whose forward fastft replaces: the lines of transformers' source (the class's) that fastft's forward
# computes again; each must still be there
FORWARD_SOURCE = {
    "MiniMaxLightningAttention": (
        "qkv_states = self.act_fn(self.qkv_proj(hidden_states))",
        "qkv_states = apply_mask_to_padding_states(qkv_states, attention_mask)",
        "qkv_states = qkv_states.reshape(batch_size, seq_len, self.num_attention_heads, 3 * self.head_dim)",
        "query_states, key_states, value_states = torch.split(qkv_states, self.head_dim, dim=3)",
        "diagonal_decay = slope_rate * diagonal_decay",
        "attn_weights_intra = torch.matmul(current_query_states, current_key_states.transpose(-1, -2))",
        "attn_output_intra = torch.matmul(attn_weights_intra * current_diagonal_decay, current_value_states)",
        "attn_output_inter = torch.matmul(current_query_states * current_query_decay, attn_weights_inter)",
        "attn_weights_inter = attn_weights_inter * block_decay + next_attn_weights_inter",
        "attn_output = attn_output.reshape(batch_size, seq_len, self.num_attention_heads * self.head_dim)",
        "attn_output = self.norm(attn_output)",
        "attn_output = F.sigmoid(self.output_gate(hidden_states)) * attn_output",
        "attn_output = self.out_proj(attn_output)",
    ),
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
    if MIXER_NAMES.search(model_type) and model_type not in STACK_MODEL_TYPES:  # theirs: checked module by module
        found.append(Blocker("config.model_type", model_type, f"a recurrent family ({model_type!r})"))
    for name in ("layer_types", "layers_block_type", "mlp_layer_types"):
        kinds = getattr(config, name, None)
        if isinstance(kinds, (list, tuple)):
            for kind in dict.fromkeys(k for k in kinds if isinstance(k, str)):
                if kind not in ATTENTION_LAYER_TYPES | MLP_LAYER_TYPES | MIXER_LAYER_TYPES:
                    found.append(Blocker(f"config.{name}", kind, f"layer type {kind!r}"))
    pattern = getattr(config, "hybrid_override_pattern", None)  # Nemotron-H: M = Mamba-2, * = attention
    if isinstance(pattern, str) and set(pattern) - HYBRID_PATTERN_LETTERS:
        letters = "".join(sorted(set(pattern) - HYBRID_PATTERN_LETTERS))
        found.append(Blocker("config.hybrid_override_pattern", pattern, f"layers of kinds {letters!r}"))
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
    with the batch's keyword arguments (or, for ``CONTEXT_LAYERS``, whose decoder layer gets them), and calls
    no fused kernel fastft does not replace; or a class whose forward fastft replaces, whose source still
    computes what fastft's forward computes (``FORWARD_SOURCE``)."""
    cls = type(module)
    names = SUPPORTED.get(cls.__name__)
    namespace = sys.modules.get(cls.__module__)
    if names is None or namespace is None:
        return False
    functions = [n for n in names if n != FORWARD]
    if not all(callable(getattr(namespace, n, None)) for n in functions):
        return False
    try:
        source = inspect.getsource(cls.forward)
        if FORWARD in names:  # the batch's info must reach the forward, which must compute what fastft's does
            class_source = inspect.getsource(cls)
            if not _takes_kwargs(cls.forward) or not all(line in class_source for line in FORWARD_SOURCE[cls.__name__]):
                return False
        context = CONTEXT_LAYERS.get(cls.__name__)
        if context is not None:  # the decoder layer gets the info and calls the mixer
            layer = getattr(namespace, context[0], None)
            if not isinstance(layer, type) or not _takes_kwargs(layer.forward):
                return False
            if not context[1].search(inspect.getsource(layer.forward)):
                return False
    except (OSError, TypeError):
        return False
    if CALLS[INNER_FN].search(source) and INNER_FN not in functions:  # Mamba-1's fused kernel, unreplaced
        return False
    return not UNHANDLED_CALLS.search(source) and all(CALLS[n].search(source) for n in functions)


def _takes_kwargs(fn) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _stack_supported(inner, stack) -> bool:
    """Whether ``stack`` is one of ``STACKS`` (no positions) whose forward still calls its blocks, and whose
    causal LM still calls it, as fastft reads them: fastft then hands its blocks the batch's info."""
    entry = STACKS.get(type(stack).__name__)
    if entry is None or stack is inner:
        return False
    block = getattr(sys.modules.get(type(stack).__module__), entry[0], None)
    try:
        return (
            isinstance(block, type)
            and _takes_kwargs(block.forward)
            and bool(entry[1].search(inspect.getsource(type(stack).forward)))
            and bool(entry[2].search(inspect.getsource(type(inner).forward)))
        )
    except (OSError, TypeError):
        return False


def packing_blockers(model) -> list[Blocker]:
    """The layers of ``model`` (a transformers model, or a PEFT wrapper's) whose token mixing fastft does not
    make packing-correct; empty when only attention and supported mixers mix tokens."""
    inner = transformers_model(model)
    modules = dict(_language_model(inner).named_modules())
    blockers = _config_blockers(inner)
    stack = decoder_stack(inner)
    takes_positions = "position_ids" in inspect.signature(stack.forward).parameters
    if not takes_positions and not _stack_supported(inner, stack):  # e.g. BART's decoder as a causal LM
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


# (modeling module name, function name) or (module name, class name, "forward") -> _Patch
_patched: dict = {}


@dataclasses.dataclass
class _Patch:
    original: object  # the module's function (or the class's forward) that fastft's wraps
    models: int  # live models using fastft's
    replacement: object  # fastft's function, as set on the module (or class)


def _replace(namespace, name: str, make=None):
    """Replace ``namespace.name`` (a modeling module's function, or with ``make`` a class's forward or
    ``__call__``) by fastft's, once for all the models that use it; returns the undo of this model's use."""
    key = (namespace.__name__, name) if make is None else (namespace.__module__, namespace.__name__, name)
    patch = _patched.setdefault(key, _Patch(None, 0, None))
    if make is None:
        get, put = functools.partial(getattr, namespace, name), functools.partial(setattr, namespace, name)
    elif name == FORWARD:  # a class's forward (inside transformers' checkpointing wrapper, where it has one)
        get, put = (
            functools.partial(versions.layer_forward, namespace),
            functools.partial(versions.set_layer_forward, namespace),
        )
    else:  # a class's own attribute (None: inherited, and deleted again on restore)
        get, put = functools.partial(namespace.__dict__.get, name), functools.partial(_set_own, namespace, name)
    current = get()
    if current is not patch.replacement or current is None:  # first use, or set anew since (a reload)
        inherited = current if current is not None else getattr(namespace, name)
        patch.original, patch.replacement = current, (make or REPLACEMENTS[name])(inherited)
        put(patch.replacement)
    patch.models += 1

    def restore():
        patch.models -= 1
        if patch.models == 0:
            _patched.pop(key)
            if get() is patch.replacement:
                put(patch.original)

    return restore


def _set_own(cls, name: str, value) -> None:
    if value is None:
        delattr(cls, name)
    else:
        setattr(cls, name, value)


def _prepare_mixers(module, args, kwargs):
    """Decoder-stack pre-hook after the attention's: LFM2's convolutions get the batch's info as ``seq_idx``;
    a packed batch builds no recurrent cache (its state would mix the documents)."""
    info = kwargs.get(PACKED_INFO_KWARG)
    if info is None:
        return args, kwargs
    return args, {**kwargs, "seq_idx": info, "use_cache": False}


def _hold_boundaries(kwargs):
    held = {k: kwargs[k] for k in BOUNDARY_KWARGS if kwargs.get(k) is not None}
    return held or None


def _hold_info(kwargs):
    return kwargs.get(PACKED_INFO_KWARG)


def _hold(module, value, var) -> list:
    """Hooks that set ``var`` to ``value(kwargs)`` while ``module``'s forward runs (and back after it, even
    when it raises)."""
    tokens = []

    def enter(module, args, kwargs):
        tokens.append(var.set(value(kwargs)))

    def leave(module, args, kwargs, output):
        if tokens:
            var.reset(tokens.pop())

    return [
        module.register_forward_pre_hook(enter, with_kwargs=True),
        module.register_forward_hook(leave, with_kwargs=True, always_call=True),
    ]


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
    restores = []
    for cls in dict.fromkeys(type(m) for m in mixers):
        namespace = sys.modules[cls.__module__]
        for name in SUPPORTED[cls.__name__]:
            if name == FORWARD:
                restores.append(_replace(cls, name, FORWARDS[cls.__name__]))
            else:
                restores.append(_replace(namespace, name))
        if cls.__name__ in CONTEXT_LAYERS:
            layer = getattr(namespace, CONTEXT_LAYERS[cls.__name__][0])
            restores.append(_replace(layer, FORWARD, FORWARDS[layer.__name__]))
    stack = decoder_stack(model)
    hooks = [stack.register_forward_pre_hook(_prepare_mixers, with_kwargs=True)]
    if _stack_supported(inner, stack):  # its causal LM and the stack hand on no boundaries: fastft does
        block = getattr(sys.modules[type(stack).__module__], STACKS[type(stack).__name__][0])
        restores.append(_replace(block, "__call__", block_call))
        hooks += _hold(inner, _hold_boundaries, CALL_KWARGS) + _hold(stack, _hold_info, STACK_INFO)

    def undo():
        for hook in hooks:
            hook.remove()
        for restore in restores:
            restore()

    state.add("mixers", sorted({type(m).__name__ for m in mixers}), undo)
    return model
