"""QLoRA in the main job (``--quant nf4``): every column's model is the same random-weight model
as without it (``fastft.e2e.stacks.build``: ``torch.manual_seed(0)`` + ``from_config``), loaded the way
users get a 4-bit model: saved once to a temporary folder (safetensors, the model's dtype) and loaded back
with transformers' ``BitsAndBytesConfig``.

- Quantized: every ``nn.Linear`` of the decoder layers, transformers' default for bitsandbytes (attention,
  dense MLP, Gated DeltaNet's projections, Qwen3.5-MoE's ``shared_expert_gate``). Not quantized: the
  embeddings and ``lm_head`` (transformers keeps the output embeddings, tied or not), the routers and the
  MoE experts (3D parameters, not ``nn.Linear``: bitsandbytes quantizes ``nn.Linear`` only), so on the MoE
  models only the attention (and shared) projections are 4-bit; norms stay in the model's dtype.
- Settings: NF4, blocks of 64 (bitsandbytes' default), double quantization (the blocks' absmax quantized
  again, as QLoRA does), compute dtype the model's (bf16 on the GPU), uint8 storage.
- ``peft.prepare_model_for_kbit_training`` is not called: TRL's SFTTrainer (1.16) does not call it for
  QLoRA (it only makes the inputs require grad, which every column's checkpointing does, and casts the
  adapters to bf16), and it casts every parameter outside the 4-bit layers (embeddings, norms, ``lm_head``)
  to fp32, a different recipe whose fp32 ``lm_head`` over 16k tokens would change every column's time and
  memory. The LoRA adapters are PEFT's default, as in the bf16 columns, so that ``--quant nf4`` changes
  the base weights only.

Only for the GPU in the main job (``why_unavailable``): bitsandbytes' 4-bit layers run on CPUs too (the CPU
tests use them), but at tiny sizes that measures nothing. bitsandbytes is imported by transformers only
when a 4-bit model is loaded: never by ``import fastft``.
"""

from __future__ import annotations

import atexit
import gc
import importlib.util
import shutil
import tempfile
from collections.abc import Hashable

import torch

QUANTS = ("none", "nf4")  # --quant choices; "none" (or None): the model's own dtype


def quant_arg(quant: str | None) -> str | None:
    """``quant`` checked: None for ``None`` or ``"none"``, else ``"nf4"``; ``ValueError`` otherwise."""
    if quant is None or quant == "none":
        return None
    if quant != "nf4":
        raise ValueError(f"quant must be None or one of {', '.join(map(repr, QUANTS))}, got {quant!r}")
    return quant


def why_unavailable(quant: str | None, device: torch.device) -> str | None:
    """Why the main job cannot train 4-bit models on ``device`` here (no GPU, bitsandbytes, accelerate or peft), or
    None (also for no ``quant``)."""
    if quant_arg(quant) is None:
        return None
    if device.type != "cuda":
        return "needs a GPU (the main job runs bitsandbytes' 4-bit layers on CUDA only)"
    missing = [p for p in ("bitsandbytes", "accelerate", "peft") if importlib.util.find_spec(p) is None]
    if missing:
        return (
            f"needs {' and '.join(missing)} (pip install {' '.join(missing)}; transformers loads 4-bit models "
            "with bitsandbytes and accelerate, the LoRA adapters are peft's)"
        )
    return None


def describe(quant: str | None) -> str | None:
    """One line for the e2e run's description, or None without ``quant``."""
    if quant_arg(quant) is None:
        return None
    return (
        "quant nf4 (QLoRA): every column's model has the decoder's nn.Linear layers in bitsandbytes 4-bit NF4 "
        "(blocks of 64, double quantization, bf16 compute; loaded through transformers' BitsAndBytesConfig), "
        "LoRA adapters on them through peft; embeddings, lm_head, norms, routers and MoE experts stay bf16"
    )


_saved: dict = {}  # key -> (folder, dtype, device): the last builder's model on disk (one at a time)


def forget_saved() -> None:
    """Remove the saved model's folder (``quantized`` saves it again when asked for it)."""
    for folder, _, _ in _saved.values():
        shutil.rmtree(folder, ignore_errors=True)
    _saved.clear()


atexit.register(forget_saved)


def _save(model) -> tuple[str, torch.dtype, torch.device]:
    folder = tempfile.mkdtemp(prefix="fastft-quant-")
    first = next(model.parameters())
    model.save_pretrained(folder)
    return folder, first.dtype, first.device


def _config(dtype: torch.dtype):
    import transformers

    return transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=True,
    )


def quantized(model_or_builder, quant: str | None, key: Hashable | None = None):
    """The model of ``model_or_builder`` (a transformers causal LM, or a function of no arguments that builds
    one) with ``quant`` applied (see the module docstring), on the same device, in train mode; without
    ``quant``, the model itself (or the builder's). A builder's model is saved once per ``key`` and loaded
    again on each call with that key (only the last key's folder is kept: one model on disk at a time); a
    model is saved, loaded, and its folder removed."""
    quant = quant_arg(quant)
    is_model = isinstance(model_or_builder, torch.nn.Module)
    if quant is None:
        return model_or_builder if is_model else model_or_builder()
    import transformers

    if is_model:
        folder, dtype, device = _save(model_or_builder)
    elif key is not None and key in _saved:
        folder, dtype, device = _saved[key]
    else:
        forget_saved()
        model = model_or_builder()
        folder, dtype, device = _save(model)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the full-precision copy's memory, before the 4-bit one loads
        if key is not None:
            _saved[key] = folder, dtype, device
    if device.type == "cuda":
        place = device.index if device.index is not None else torch.cuda.current_device()
    else:
        place = device.type
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=_config(dtype), device_map={"": place}, dtype=dtype
        )
    finally:
        if is_model or key is None:
            shutil.rmtree(folder, ignore_errors=True)
    return model.train()
