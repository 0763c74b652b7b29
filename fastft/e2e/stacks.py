"""The stacks the main job compares (``python -m fastft e2e``, ``fastft.e2e.run``): one ``Column`` each,
built on a transformers model with random weights from ``fastft.e2e.models``.

- ``naive glue``: what the "25% faster" claim was measured against: packed attention that rebuilds the
  document boundaries in every layer with host syncs, single-buffered offloaded checkpointing, and
  transformers' per-expert MoE loop;
- ``stock sdpa``: transformers with ``sdpa`` (its packed mask from position ids; gpt-oss: ``eager``, the
  one that takes its attention sinks), ``torch.utils.checkpoint``, and its default experts
  implementation (``grouped_mm``);
- ``stock sdpa, padded``: the same documents one per row, right-padded (``attention_mask``, labels -100 on
  padding), in micro-batches of at most the row's token budget (``padded_budget``: less where stock's padded step
  does not fit it), padding included, accumulated into one step
  (``fastft.e2e.stream.padded``: what a user does when packing is wrong for the model; no sorting by
  length); correct on every model, and the only correct stock column on models whose layers mix tokens
  outside attention (Gated DeltaNet). Its tokens/s counts the documents' tokens, not the padding;
- ``stock sdpa, fla`` and ``stock sdpa, padded, fla`` (models with Gated DeltaNet layers; needs
  flash-linear-attention, import name ``fla``): the same two with transformers' flash-linear-attention
  kernels, which transformers uses whenever ``fla`` is installed; every other stock column runs transformers'
  torch functions in those layers even then (``_torch_mixers``), so "with" and "without" are both measured;
- ``stock sdpa, hf offload``: the same with transformers' own offload
  (``gradient_checkpointing_enable(offload=True)``: checkpoint inputs in pinned host memory, copied on the
  compute stream; GPU only: transformers 5.17 pins host memory, which a CPU-only torch cannot);
- ``stock flex``: the same as ``stock sdpa`` with ``flex_attention``, transformers' fastest attention here
  without flash-attn (GPU only; it compiles its kernels in the first steps, for minutes);
- ``liger + stock flex``: ``stock flex`` on a model that Liger-Kernel patched in place with its defaults
  (RMSNorm, rotary, SwiGLU or fused MoE, fused linear cross entropy; GPU and liger-kernel only);
- ``fastft, peft lora``: ``fastft.integrations.transformers.apply(model, lora=False)``, PEFT's own LoRA
  forward (shows what the LoRA path adds; needs peft);
- ``fastft``: ``fastft.integrations.transformers.apply`` on the PEFT model;
- ``fastft + liger``: ``apply`` on a model that Liger patched first (fastft keeps its experts path);
- ``fastft, experts lora`` (MoE models, peft): ``fastft`` with LoRA also on the experts' weights (PEFT
  ``target_parameters``), what MoE fine-tunes train;
- ``fastft, graphs`` and ``fastft + liger, graphs``: the same with ``apply(..., graphs=True)``, each
  checkpointed layer replayed as CUDA graphs (GPU only; a new batch signature is captured when it comes);
  ``fastft + liger, graphs auto``: ``graphs="auto"``, graphs only for layers whose eager forward is
  launch-bound; ``fastft + liger, graphs, experts lora`` (MoE models): LoRA on the experts' weights too.
- ``fastft, memory plan`` and ``fastft + liger, memory plan`` (GPU only): ``apply(..., memory_budget="auto",
  max_tokens=<the row's token budget>)``: each checkpointed layer keeps, saves its GEMMs' results, recomputes or
  offloads as the GPU's free memory allows (``fastft.memory_planner``), where the other fastft columns
  recompute every layer.
- ``unsloth`` (GPU and unsloth only): Unsloth's own stack (``fastft.e2e.unsloth``, in a process of its own:
  Unsloth patches transformers, peft and trl when imported): the same weights saved and loaded through
  ``FastLanguageModel`` (MoE models: ``FastModel``), LoRA r=16 on the same projections through its
  ``get_peft_model``, its gradient checkpointing, the same packed rows with their boundaries as
  ``packed_seq_lengths``; a peer.

Every column but naive glue's trains LoRA r=16 through PEFT (all weights without peft), with gradient
checkpointing. Peers (``Column.peer``) are the columns users run without fastft: ``stock *``,
``liger + stock flex`` and ``unsloth``.

A packed column leaks (``leaks``: documents of a row see each other) where stock transformers does not keep
them apart: on models whose layers mix tokens outside attention (every stock and naive packed column:
transformers' torch fallbacks ignore the documents, and so does its ``fla`` path given ``position_ids``), and
on gpt-oss, whose stock attention ignores packed position ids. fastft's columns and the padded ones never
leak. The e2e table marks leaking columns, leaves them out of "vs fastest peer" and out of the loss check's
reference.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import quant as quantization
from .models import MODEL_CONFIGS as MODELS
from .models import budget, dtype_for, has_mixers, has_sinks, is_moe, mixer_modules, model_config, padded_budget
from .stream import step_inputs

LIGER_FAMILIES = {
    "LlamaConfig": "llama",
    "Qwen3Config": "qwen3",
    "Qwen3MoeConfig": "qwen3_moe",
    "GptOssConfig": "gpt_oss",
}


def _naive_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """Packed attention the way per-layer glue does it: boundaries rebuilt in every layer, with syncs."""
    from fastft import attention

    flat = kwargs["position_ids"].reshape(-1)
    starts = (flat == 0).nonzero().flatten()  # sync
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).int()
    max_seqlen = int((cu[1:] - cu[:-1]).max())  # sync
    window = int(sliding_window) if sliding_window else None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    sinks = getattr(module, "sinks", None)
    if sinks is None and v.shape[-1] == q.shape[-1] and attention.flash_reason(q, k, None, dropout, window) is None:
        b, t, h, d = q.shape
        flat_qkv = (x.reshape(b * t, x.shape[2], d) for x in (q, k, v))
        out = attention.flash_op(*flat_qkv, cu, max_seqlen, scaling or d**-0.5, window, None)
        return out.view(b, t, h, d), None
    doc = torch.zeros_like(flat).index_fill_(0, starts[1:], 1).cumsum(0)
    q, k = torch.arange(flat.numel(), device=flat.device)[:, None], torch.arange(flat.numel(), device=flat.device)[None]
    ok = (doc[:, None] == doc[None]) & (k <= q) & ((q - k < window) if window else True)
    if sinks is not None:
        import sys

        mask = torch.zeros(ok.shape, dtype=query.dtype, device=ok.device).masked_fill(~ok, float("-inf"))[None, None]
        return sys.modules[type(module).__module__].eager_attention_forward(
            module, query, key, value, mask, scaling=scaling, dropout=dropout
        )
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=ok[None, None], scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _liger(model, name: str):
    """Liger-Kernel's defaults on ``model`` in place; returns a function that puts back the transformers
    module globals Liger also patches (its rotary is read at forward time: call it after the column ran)."""
    import importlib

    from liger_kernel.transformers import monkey_patch

    family = LIGER_FAMILIES[MODELS[name][0]]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    saved, cross_entropy = dict(vars(module)), F.cross_entropy
    getattr(monkey_patch, f"apply_liger_kernel_to_{family}")(model=model)

    def restore():
        for extra in set(vars(module)) - set(saved):
            delattr(module, extra)
        vars(module).update(saved)
        F.cross_entropy = cross_entropy

    return restore


def _nothing() -> None:
    pass


def lora_targets(model, name: str) -> list[str]:
    """The module names LoRA goes on in the e2e model ``name``: the attention (and dense MLP) projections and
    the linear layers of the other token mixers (Gated DeltaNet's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
    out_proj)."""
    moe = is_moe(name)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj", "up_proj", "down_proj"])
    mixer_linears = (n for m in mixer_modules(model) for n, c in m.named_children() if isinstance(c, torch.nn.Linear))
    return targets + list(dict.fromkeys(mixer_linears))


def _peft(model, name: str, experts: bool = False):
    """(model, whether LoRA is on): PEFT's LoRA r=16 on the attention (and dense MLP) projections, and on the
    experts' weights with ``experts``; the model itself when peft is not installed (all weights train)."""
    try:
        import peft
    except ImportError:
        return model, False
    targets = lora_targets(model, name)
    on_experts = ["experts.gate_up_proj", "experts.down_proj"] if experts else None
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, target_parameters=on_experts)
    return peft.get_peft_model(model, lora), True


def _with_liger(setup):
    """``setup`` on a model that Liger-Kernel patched first; Liger's restore is returned with the stack."""

    @functools.wraps(setup)
    def liger_setup(model, name: str):
        restore = _liger(model, name)
        try:
            model, lora, _ = setup(model, name)
        except BaseException:
            restore()
            raise
        return model, lora, restore

    return liger_setup


def _naive_setup(model, name: str):
    import transformers

    import fastft

    transformers.AttentionInterface.register("naive_packed", _naive_attention)
    model.set_attn_implementation("naive_packed")
    model.gradient_checkpointing_enable()
    single = fastft.OffloadConfig(enabled=True, double_buffer=False)
    model._set_gradient_checkpointing(
        True, lambda f, *a, **k: fastft.offloaded_checkpoint(f, *a, offload_config=single, **k)
    )
    if is_moe(name):
        model.set_experts_implementation("eager")
    return *_peft(model, name), _nothing


def _torch_mixers(model):
    """transformers' own torch functions in the token mixers of ``model`` (its modeling module's
    ``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``), where it would call flash-linear-attention's or
    causal-conv1d's kernels because they are installed; returns the function that puts those back."""
    from fastft.integrations.transformers import mixers

    saved = {}
    for module in mixer_modules(model):
        namespace = sys.modules[type(module).__module__]
        for fn in mixers.SUPPORTED[type(module).__name__]:
            saved.setdefault((namespace, fn), getattr(namespace, fn))
    for (namespace, fn), current in saved.items():
        setattr(namespace, fn, inspect.unwrap(current))  # transformers' wrapper around its torch function

    def restore():
        for (namespace, fn), current in saved.items():
            setattr(namespace, fn, current)

    return restore


def _stock_setup(model, name: str, attention: str = "sdpa", offload: bool = False, fla: bool = False):
    model.set_attn_implementation("eager" if attention == "sdpa" and has_sinks(name) else attention)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=offload)
    if is_moe(name):
        model.set_experts_implementation("grouped_mm")
    model, lora = _peft(model, name)
    return model, lora, _nothing if fla else _torch_mixers(model)


def _fastft_setup(
    model, name: str, lora: bool = True, experts: bool = False, graphs: bool | str = False, plan: bool = False
):
    import warnings

    from fastft.integrations import transformers as ft_hf

    model, has_lora = _peft(model, name, experts)
    # the plan is made for the stream's largest row (real size: the GPU columns' rows), not for its first
    memory = dict(memory_budget="auto", max_tokens=budget(name, tiny=False)) if plan else {}
    with warnings.catch_warnings():  # "fastft + liger": fastft keeps its experts path, as it says
        warnings.filterwarnings("ignore", "Liger-Kernel's swiglu patch")
        ft_hf.apply(model, lora=lora, graphs=graphs, **memory)
    return model, has_lora, _nothing


def _in_own_process(model, name: str):
    raise RuntimeError("this column runs in a process of its own (Column.own_process), never in this one")


@dataclasses.dataclass(frozen=True)
class Column:
    """One stack under test (see the module docstring)."""

    name: str
    setup: Callable  # (model, model name) -> (model, whether LoRA is on, restore: call after the column ran)
    gpu_only: bool = False  # needs CUDA (compiled kernels, pinned host memory, CUDA graphs)
    needs: tuple[str, ...] = ()  # optional packages it needs besides transformers (pip names)
    peer: bool = False  # a stack users run without fastft: the "vs fastest peer" baselines
    fastft: bool = False  # fastft's stack: the loss check fails on it, and it is compared with the peers
    moe_only: bool = False  # runs on MoE models only
    mixers_only: bool = False  # runs on models whose layers mix tokens outside attention only
    padded: bool = False  # trains on the stream's documents padded (``fastft.e2e.stream.padded``), not packed
    # runs in a process of its own (``fastft.e2e.unsloth``), never through ``setup``
    own_process: bool = False


COLUMNS = {
    c.name: c
    for c in (
        Column("naive glue", _naive_setup),
        Column("stock sdpa", _stock_setup, peer=True),
        Column("stock sdpa, padded", _stock_setup, peer=True, padded=True),
        Column(
            "stock sdpa, fla",
            functools.partial(_stock_setup, fla=True),
            needs=("flash-linear-attention",),
            peer=True,
            mixers_only=True,
        ),
        Column(
            "stock sdpa, padded, fla",
            functools.partial(_stock_setup, fla=True),
            needs=("flash-linear-attention",),
            peer=True,
            mixers_only=True,
            padded=True,
        ),
        Column("stock sdpa, hf offload", functools.partial(_stock_setup, offload=True), gpu_only=True, peer=True),
        Column("stock flex", functools.partial(_stock_setup, attention="flex_attention"), gpu_only=True, peer=True),
        Column(
            "liger + stock flex",
            _with_liger(functools.partial(_stock_setup, attention="flex_attention")),
            gpu_only=True,
            needs=("liger-kernel",),
            peer=True,
        ),
        # without peft, "fastft, peft lora" would be "fastft" again
        Column("fastft, peft lora", functools.partial(_fastft_setup, lora=False), needs=("peft",), fastft=True),
        Column("fastft", _fastft_setup, fastft=True),
        Column("fastft + liger", _with_liger(_fastft_setup), gpu_only=True, needs=("liger-kernel",), fastft=True),
        Column(
            "fastft, experts lora",
            functools.partial(_fastft_setup, experts=True),
            needs=("peft",),
            fastft=True,
            moe_only=True,
        ),
        Column("fastft, graphs", functools.partial(_fastft_setup, graphs=True), gpu_only=True, fastft=True),
        Column(
            "fastft + liger, graphs",
            _with_liger(functools.partial(_fastft_setup, graphs=True)),
            gpu_only=True,
            needs=("liger-kernel",),
            fastft=True,
        ),
        Column(
            "fastft + liger, graphs auto",
            _with_liger(functools.partial(_fastft_setup, graphs="auto")),
            gpu_only=True,
            needs=("liger-kernel",),
            fastft=True,
        ),
        Column(
            "fastft + liger, graphs, experts lora",
            _with_liger(functools.partial(_fastft_setup, experts=True, graphs=True)),
            gpu_only=True,
            needs=("liger-kernel", "peft"),
            fastft=True,
            moe_only=True,
        ),
        Column("fastft, memory plan", functools.partial(_fastft_setup, plan=True), gpu_only=True, fastft=True),
        Column(
            "fastft + liger, memory plan",
            _with_liger(functools.partial(_fastft_setup, plan=True)),
            gpu_only=True,
            needs=("liger-kernel",),
            fastft=True,
        ),
        Column("unsloth", _in_own_process, gpu_only=True, needs=("unsloth",), peer=True, own_process=True),
    )
}


def build(name: str, column: str, device, tiny: bool, model=None, quant=None, layers=None):
    """The stack of ``column`` on the model ``name``: ((model, whether LoRA is on), a function to call after
    the column ran, which puts back the module globals the stack patched: Liger's, and the stock columns'
    torch mixers (``_torch_mixers``)). ``model``: one already built from ``model_config`` (e.g. loaded under
    a distributed plan) instead of a fresh one with the fixed seed. ``quant``: ``"nf4"``, the fresh model's
    decoder linear layers in bitsandbytes 4-bit (``fastft.e2e.quant.quantized``; saved once per model and
    loaded for each column). ``layers``: the decoder layers kept (``fastft.e2e.models.layers_arg``)."""
    import transformers

    quant = quantization.quant_arg(quant)
    if model is not None and quant is not None:
        raise ValueError("build: quant is taken for a fresh model only, not with model=")

    def fresh():
        torch.manual_seed(0)
        with torch.device(device):  # initialise on the device: minutes on a CPU for billions of weights
            config = model_config(name, tiny, layers)
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype_for(device))

    if model is None:
        model = quantization.quantized(fresh, quant, key=(name, tiny, layers, str(device)))
        if quant is not None:  # the adapters' initialisation: the same in each column, built or loaded again
            torch.manual_seed(0)
    model, lora, restore = COLUMNS[column].setup(model.train(), name)
    return (model, lora), restore


IMPORT_NAMES = {"flash-linear-attention": "fla"}  # pip name -> import name, where not the pip name with "_"


def installed(package: str) -> bool:
    """Whether the optional package ``package`` (its pip name) can be imported here."""
    import importlib.util

    return importlib.util.find_spec(IMPORT_NAMES.get(package, package.replace("-", "_"))) is not None


def why_not(column: str, device: torch.device) -> str | None:
    """Why ``column`` cannot run on ``device`` here (a GPU or a package it needs is missing), or None."""
    c = COLUMNS[column]
    missing = [p for p in c.needs if not installed(p)]
    if c.gpu_only and device.type != "cuda":
        return "needs a GPU"
    if missing:
        return f"needs {' and '.join(missing)} (pip install {' '.join(missing)})"
    return None


def why_not_on(column: str, name: str) -> str | None:
    """Why ``column`` does not run on the e2e model ``name`` (it is not a model of its kind), or None."""
    c = COLUMNS[column]
    if c.moe_only and not is_moe(name):
        return "needs a MoE model"
    if c.mixers_only and not has_mixers(name):
        return "needs a model with linear-attention layers"
    if "flex" in column and has_mixers(name):
        return "transformers offers no flex_attention for its hybrid families"
    if column == "naive glue" and MODELS[name][1].get("position_embedding_type") == "nope":
        return "its attention layers get no position ids (no position embedding), where this glue finds documents"
    if "liger-kernel" in c.needs and MODELS[name][0] not in LIGER_FAMILIES:
        return f"needs a model whose family fastft's bench patches with Liger-Kernel ({', '.join(LIGER_FAMILIES)})"
    return None


def leaks(column: str, name: str) -> str | None:
    """Why ``column`` lets the documents of a packed row see each other on the e2e model ``name`` (see the
    module docstring), or None."""
    c = COLUMNS[column]
    if c.fastft or c.padded:
        return None
    if c.own_process:  # unsloth: its own packing (packed_seq_lengths); the loss check tells
        return None
    if has_mixers(name):
        return "its layers mix tokens outside attention, across documents"
    if has_sinks(name) and c.peer:
        return "transformers' gpt-oss attention ignores packed position ids"
    return None


def columns(device: torch.device, only=None) -> list[str]:
    """The columns that run here (see the module docstring): those of ``only`` in its order (a run's first
    column can pay one-time costs: name the columns in another order to see them), else all in table order."""
    names = dict.fromkeys(only) if only else COLUMNS
    return [c for c in names if c in COLUMNS and why_not(c, device) is None]


def column_inputs(column: str, batch, name: str, tiny: bool, host_lengths: bool = False):
    """What ``column`` feeds the model ``name`` for one step on ``batch`` (``fastft.e2e.stream.step_inputs``):
    the packed row, or for a padded column its documents padded to micro-batches of ``padded_budget``."""
    return step_inputs(batch, padded_budget(name, tiny) if COLUMNS[column].padded else None, host_lengths)


def record_facts(column: str, name: str, tiny: bool, layers=None) -> dict:
    """The facts of ``column`` on the model ``name`` (``layers``: as ``build``'s) that ``fastft.e2e.train.record``
    takes as keywords (besides dtype, lora and quant, which the built model tells)."""
    return dict(
        layers=model_config(name, tiny, layers).num_hidden_layers,
        padded_budget=padded_budget(name, tiny) if COLUMNS[column].padded else None,
        leaks=leaks(column, name) is not None,
    )
