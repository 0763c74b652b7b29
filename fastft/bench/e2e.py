"""End-to-end fine-tuning step (``python -m fastft bench --e2e``): transformers models built from configs
with random weights, one packed row of documents drawn from an SFT-like length distribution, LoRA
(peft, when installed; else all weights train) with AdamW, bf16, gradient checkpointing on.

Columns, one model build each, same weights and batch:
- ``naive glue``: what the "25% faster" claim was measured against: packed attention that rebuilds the
  document boundaries in every layer with host syncs, single-buffered offloaded checkpointing, and
  transformers' per-expert MoE loop;
- ``stock sdpa``: transformers with ``sdpa`` (its packed mask from position ids; gpt-oss: ``eager``, the
  one that takes its attention sinks), ``torch.utils.checkpoint``, and its default experts
  implementation (``grouped_mm``);
- ``stock sdpa, hf offload``: the same with transformers' own offload
  (``gradient_checkpointing_enable(offload=True)``: checkpoint inputs in pinned host memory, copied on the
  compute stream; GPU only);
- ``stock flex``: the same as ``stock sdpa`` with ``flex_attention``, transformers' fastest attention here
  without flash-attn (GPU only: it compiles its kernels for minutes on the first step, which is not timed);
- ``liger + stock flex``: ``stock flex`` on a model that Liger-Kernel patched in place with its defaults
  (RMSNorm, rotary, SwiGLU or fused MoE, fused linear cross entropy; GPU and liger-kernel only);
- ``fastft, peft lora``: ``fastft.integrations.transformers.apply(model, lora=False)``, PEFT's own LoRA
  forward (shows what the LoRA path adds);
- ``fastft``: ``fastft.integrations.transformers.apply`` on the PEFT model;
- ``fastft + liger``: ``apply`` on a model that Liger patched first (fastft keeps its experts path);
- ``fastft, experts lora`` (MoE models): ``fastft`` with LoRA also on the experts' weights (PEFT
  ``target_parameters``), what MoE fine-tunes train;
- ``fastft, graphs`` and ``fastft + liger, graphs``: the same with ``apply(..., graphs=True)``, each
  checkpointed layer replayed as CUDA graphs (GPU only; captured on the first, untimed steps).

Peers are the columns users run without fastft: ``stock *`` and ``liger + stock flex``.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from fastft.testing import MODEL_CONFIGS as MODELS
from fastft.testing import sft_lengths

TINY = dict(
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_experts=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    sliding_window=16,
)
COLUMNS = (
    "naive glue",
    "stock sdpa",
    "stock sdpa, hf offload",
    "stock flex",
    "liger + stock flex",
    "fastft, peft lora",
    "fastft",
    "fastft + liger",
    "fastft, experts lora",
    "fastft, graphs",
    "fastft + liger, graphs",
)
PEERS = ("stock sdpa", "stock sdpa, hf offload", "stock flex", "liger + stock flex")
# hf offload: transformers 5.17's pins host memory, which a CPU-only torch cannot
GPU_ONLY = (
    "stock sdpa, hf offload",
    "stock flex",
    "liger + stock flex",
    "fastft + liger",
    "fastft, graphs",
    "fastft + liger, graphs",
)
LIGER = ("liger + stock flex", "fastft + liger", "fastft + liger, graphs")
LIGER_FAMILIES = {
    "LlamaConfig": "llama",
    "Qwen3Config": "qwen3",
    "Qwen3MoeConfig": "qwen3_moe",
    "GptOssConfig": "gpt_oss",
}
TOKENS = {"gpt-oss-20b": 4096}


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
    if sinks is None and attention.flash_reason(q, k, None, dropout, window) is None:
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


def _liger(model, config_cls: str):
    """Liger-Kernel's defaults on ``model`` in place; returns a function that puts back the transformers
    module globals Liger also patches (its rotary is read at forward time: call it after the column ran)."""
    import importlib

    from liger_kernel.transformers import monkey_patch

    family = LIGER_FAMILIES[config_cls]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    saved, cross_entropy = dict(vars(module)), F.cross_entropy
    getattr(monkey_patch, f"apply_liger_kernel_to_{family}")(model=model)

    def restore():
        for extra in set(vars(module)) - set(saved):
            delattr(module, extra)
        vars(module).update(saved)
        F.cross_entropy = cross_entropy

    return restore


def model_config(name: str, tiny: bool):
    """The transformers config of an e2e model (``tiny``: 2 layers, small widths)."""
    import transformers

    config_cls, fields, layers = MODELS[name]
    fields = dict(fields, num_hidden_layers=layers)
    if tiny:
        fields.update({k: v for k, v in TINY.items() if k in fields}, num_hidden_layers=2)
    return getattr(transformers, config_cls)(**fields, use_cache=False)


def dtype_for(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build(name: str, column: str, device, tiny: bool, model=None):
    """((model, whether LoRA is on), a function to call after the column ran: it undoes Liger's module patches).
    ``model``: one already built from ``model_config`` (e.g. loaded under a distributed plan) instead of a
    fresh one with the fixed seed."""
    import transformers

    from fastft.integrations import transformers as ft_hf

    if model is None:
        torch.manual_seed(0)
        with torch.device(device):  # initialise on the device: minutes on a CPU for billions of weights
            model = transformers.AutoModelForCausalLM.from_config(model_config(name, tiny), dtype=dtype_for(device))
    model = model.train()
    moe = ft_hf.has_experts(model)
    restore = _liger(model, MODELS[name][0]) if column in LIGER else (lambda: None)
    try:
        return _stack(model, name, column, moe), restore
    except BaseException:
        restore()
        raise


def _stack(model, name: str, column: str, moe: bool):
    """``build``'s column set-up on a built model: (model, whether LoRA is on)."""
    import warnings

    import transformers

    import fastft
    from fastft.integrations import transformers as ft_hf

    if column == "naive glue":
        transformers.AttentionInterface.register("naive_packed", _naive_attention)
        model.set_attn_implementation("naive_packed")
        model.gradient_checkpointing_enable()
        single = fastft.OffloadConfig(enabled=True, double_buffer=False)
        model._set_gradient_checkpointing(
            True, lambda f, *a, **k: fastft.offloaded_checkpoint(f, *a, offload_config=single, **k)
        )
    elif not column.startswith("fastft"):
        attention = "flex_attention" if column.endswith("flex") else "eager" if name.startswith("gpt-oss") else "sdpa"
        model.set_attn_implementation(attention)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}, offload=column.endswith("hf offload")
        )
    if moe and not column.startswith("fastft"):
        model.set_experts_implementation("eager" if column == "naive glue" else "grouped_mm")
    try:
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj", "up_proj", "down_proj"])
        experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if column == "fastft, experts lora" else None
        lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, target_parameters=experts)
        model = peft.get_peft_model(model, lora)
        lora = True
    except ImportError:
        lora = False
    if column.startswith("fastft"):
        with warnings.catch_warnings():  # "fastft + liger": fastft keeps its experts path, as it says
            warnings.filterwarnings("ignore", "Liger-Kernel's swiglu patch")
            ft_hf.apply(model, lora=column != "fastft, peft lora", graphs=column.endswith(", graphs"))
    return model, lora


def describe(device: torch.device, quick: bool) -> str:
    """What the run measures, said before it starts."""
    lora = _installed("peft")
    lines = []
    if device.type != "cuda" or quick:
        lines.append(
            f"e2e on {device.type}: tiny 2-layer configs of each model, 256 tokens, "
            f"{'bf16' if device.type == 'cuda' else 'fp32'}; the step times show that each stack runs, not how "
            "fast it is (tiny CPU steps vary by an order of magnitude between identical runs)"
        )
    else:
        lines.append("e2e on the GPU: real-size configs (fewer layers for the large ones), bf16, 16k packed tokens")
    if lora:
        lines.append("LoRA r=16 on the attention (and dense MLP) projections through peft, AdamW")
    else:
        lines.append(
            "peft is not installed: all weights train, so 'fastft, peft lora' would repeat 'fastft' and is "
            "skipped (pip install peft for the LoRA columns)"
        )
    if device.type != "cuda":
        lines.append(f"{', '.join(GPU_ONLY)} need a GPU and are skipped; no peak memory without one")
        if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("FASTFT_BACKEND", "auto") != "torch":
            lines.append(
                "fastft columns run its Triton kernels in Triton's interpreter, slowly by design "
                "(FASTFT_BACKEND=torch runs its torch path)"
            )
    elif not _installed("liger_kernel"):
        lines.append(f"liger-kernel is not installed: {', '.join(LIGER)} are skipped (pip install liger-kernel)")
    lines.append(
        "each column starts from the same weights and batch: fastft's first-step losses must equal naive "
        "glue's, or stock sdpa's without naive glue (exit status 1 if not)"
    )
    return "\n".join("  " + line for line in lines)


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def columns(device: torch.device, only=None) -> list[str]:
    """The columns that run here (see the module docstring), of ``only`` if given."""
    skip = set(GPU_ONLY) if device.type != "cuda" else set()
    if not _installed("liger_kernel"):
        skip.update(LIGER)
    if not _installed("peft"):
        skip.update(("fastft, peft lora", "fastft, experts lora"))
    return [c for c in COLUMNS if c not in skip and (not only or c in only)]


def loss_check(records: list[dict]) -> tuple[bool, str]:
    """(fastft agrees, one line per model): each column's first-step loss on the same weights and batch
    against ``naive glue`` (documents kept apart by a plain mask), or against ``stock sdpa`` when naive glue
    did not run (not for gpt-oss, whose stock attention lets documents see each other), within 1e-4 relative
    in fp32 and 2e-2 in bf16 (attention kernels sum in other orders). A fastft column outside that fails the
    check; another column outside it is reported."""
    ok, lines = True, []
    for name in dict.fromkeys(r["model"] for r in records):
        rows = {r["column"]: r for r in records if r["model"] == name and math.isfinite(r["loss"])}
        reference = "naive glue" if "naive glue" in rows or name.startswith("gpt-oss") else "stock sdpa"
        base = rows.get(reference)
        if base is None:
            continue
        tol = 2e-2 if base["dtype"] == "bfloat16" else 1e-4
        parts = []
        for column, r in rows.items():
            if column == reference:
                continue
            rel = abs(r["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-6)
            good = rel <= tol
            if column.startswith("fastft"):
                ok &= good
                parts.append(f"{column} {rel:.1e}" + ("" if good else " FAILS"))
            else:
                parts.append(f"{column} {rel:.1e}" + ("" if good else " (differs)"))
        lines.append(
            f"loss check {name}: relative difference to {reference} ({base['loss']:.5f}, tolerance "
            f"{tol:g}): " + ", ".join(parts)
        )
    return ok, "\n".join(lines)


def step_ms(model, batch, steps: int, device) -> tuple[float, int, float]:
    """(median step ms, peak bytes (CUDA graph pools included), first step's loss)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    times = []
    first_loss = float("nan")
    for i in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
            if i == 2:
                torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if start is not None:
            start.record()
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        if i == 0:
            first_loss = loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1000
        if i >= 2:
            times.append(ms)
    peak = torch.cuda.max_memory_allocated() + graph_pool_bytes() if device.type == "cuda" else -1
    return statistics.median(times), peak, first_loss


def graph_pool_bytes() -> int:
    """Memory that CUDA graphs' private pools hold beyond live tensors: their replays use it, the allocator's
    peak does not count it."""
    segments = torch.cuda.memory_snapshot()
    return sum(
        s["total_size"] - s["allocated_size"] for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)
    )


def make_batch(name: str, device, tiny: bool, seed: int = 0) -> tuple[dict, list[int]]:
    """The model's packed batch (one row of documents drawn from ``seed``) and its document lengths."""
    tokens = 256 if tiny else TOKENS.get(name, 16384)
    lengths = sft_lengths(tokens, median=40 if tiny else 380, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 256 if tiny else 128000, (1, tokens), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids.to(device), "labels": ids.to(device), "position_ids": positions.to(device)}, lengths


def run(device: torch.device, quick: bool, models=None, only_columns=None) -> list[dict]:
    """One record per (model, column): median step ms, tokens/s, peak bytes."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("the end-to-end benchmark needs transformers (pip install transformers)")
        return []
    tiny = device.type != "cuda" or quick
    records = []
    for name in models or MODELS:
        batch, lengths = make_batch(name, device, tiny)
        tokens = batch["input_ids"].shape[1]
        moe = MODELS[name][0] in ("Qwen3MoeConfig", "GptOssConfig")
        for column in columns(device, only_columns):
            if column == "fastft, experts lora" and not moe:
                continue
            (model, lora), restore = build(name, column, device, tiny)
            dtype = next(model.parameters()).dtype
            try:
                ms, peak, loss = step_ms(model, batch, 2 if tiny else 3, device)
            except torch.OutOfMemoryError:
                ms, peak, loss = float("nan"), -1, float("nan")
            finally:
                restore()
            peak_gib = peak / 2**30 if peak >= 0 else None
            records.append(
                {
                    "model": name,
                    "column": column,
                    "step_ms": ms,
                    "tokens_per_s": tokens / ms * 1000,
                    "peak_gib": peak_gib,
                    "tokens": tokens,
                    "documents": len(lengths),
                    "lora": lora,
                    "layers": 2 if tiny else MODELS[name][2],
                    "loss": loss,
                    "dtype": str(dtype).split(".")[-1],
                }
            )
            memory = f"peak {peak_gib:6.2f} GiB" if peak_gib is not None else "peak n/a (no GPU)"
            print(
                f"{name:14s} {column:22s} {ms:9.1f} ms/step  {tokens / ms * 1000:9.0f} tok/s  {memory}  "
                f"loss {loss:.5f}",
                flush=True,
            )
            del model
            gc.collect()  # hooks and bound methods (fastft's, Liger's, PEFT's) make cycles: free them before the next
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return records


def format_table(records: list[dict]) -> str:
    """One row per (model, column): time, tokens/s, peak memory; each column's time over fastft's, and each
    fastft column's speedup over the fastest peer column of its model (named)."""
    by = {(r["model"], r["column"]): r for r in records}
    lines = [
        "| model | layers | tokens | column | step ms | tokens/s | peak GiB | ms / fastft's | vs fastest peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ours = by.get((r["model"], "fastft"))
        ratio = f"{r['step_ms'] / ours['step_ms']:.2f}x" if ours and r["column"] != "fastft" else "-"
        peers = [
            p for p in records if p["model"] == r["model"] and p["column"] in PEERS and math.isfinite(p["step_ms"])
        ]
        best = min(peers, key=lambda p: p["step_ms"]) if peers else None
        versus = (
            f"{best['step_ms'] / r['step_ms']:.2f}x ({best['column']})"
            if best and r["column"].startswith("fastft")
            else "-"
        )
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['tokens']} | {r['column']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {peak} | {ratio} | {versus} |"
        )
    return "\n".join(lines)


def chart(records: list[dict], path: str) -> bool:
    """Bar chart of tokens/s per model and column, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(dict.fromkeys(r["model"] for r in records))
    columns = [c for c in COLUMNS if any(r["column"] == c for r in records)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(columns)
    for i, c in enumerate(columns):
        values = [next((r["tokens_per_s"] for r in records if r["model"] == n and r["column"] == c), 0) for n in names]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=c)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names)
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True
