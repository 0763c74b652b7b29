"""The ``unsloth`` column of the main job (``python -m fastft e2e --column unsloth``): Unsloth's
own fine-tuning stack on the same model, weights and stream as the other columns, in a process of its own.

Unsloth patches transformers, peft, trl and accelerate when it is imported, so it is never imported into the
benchmark's process: ``run_unsloth_column`` (the column's ``Column.own_process``) starts
``python -m fastft.e2e.unsloth`` (``command``, ``environment``), whose output and errors go to the benchmark's
own, and reads back its record (``fastft.e2e.train.record``'s fields, plus the ones below).

In the worker (``main``):

- the model: ``torch.manual_seed(0)`` and ``AutoModelForCausalLM.from_config(model_config(name, tiny, layers))``
  in bf16, the weights every column starts from (``fastft.e2e.stacks.build``), saved to a temporary folder with a small
  word-level tokenizer built here (``save_model``: Unsloth's loader looks for a tokenizer beside the weights and
  goes to the hub without one), and loaded back with ``FastLanguageModel.from_pretrained`` (MoE and
  linear-attention models: ``FastModel``, after ``enable_hf_packed_attention``) offline
  (``local_files_only``, ``use_exact_model_name``), 16-bit or, with ``--quant nf4``, Unsloth's 4-bit load;
- LoRA r=16, alpha 32, no dropout, on the modules the other columns put it on
  (``fastft.e2e.stacks.lora_targets``), through Unsloth's ``get_peft_model`` with its own gradient
  checkpointing (``use_gradient_checkpointing="unsloth"``);
- the steps: ``fastft.e2e.train.train`` (AdamW lr 1e-5, each step's loss read, peak reserved memory from the
  first timed step on) over ``fastft.e2e.stream.stream_batches``, the same rows as the other columns, each fed as
  the packed row's ``input_ids``, ``position_ids`` and ``labels`` and its documents' lengths as
  ``packed_seq_lengths`` (a CPU int32 tensor: Unsloth reads it without a host sync and masks the labels at the
  documents' boundaries, which the stream's labels already hold). From ``position_ids`` alone it would find the
  boundaries with a sync.

Fields it adds to the record: ``backend`` (the attention path Unsloth chose for packed rows, and how many packed
attention calls took each of its routes in Python: torch ``varlen_attn``, one SDPA call per run of
equal-length documents, a dense packed mask), ``moe_backend`` (MoE models: ``UNSLOTH_MOE_BACKEND``'s choice:
grouped_mm, unsloth_triton or native_torch), ``unsloth`` (its version), ``alloc_conf`` (the worker's
``PYTORCH_ALLOC_CONF``) and ``alloc_conf_same`` (whether the other columns, in the benchmark's process, run with
the same allocator setting), ``error`` (why no step ran, if none did).

The allocator: Unsloth sets ``PYTORCH_ALLOC_CONF=expandable_segments:True`` when unset. The other columns run
with the benchmark process's setting: torch's default (no expandable segments) unless ``PYTORCH_ALLOC_CONF`` is
set for the run. The worker gets the benchmark's setting when it has one, else Unsloth's default, and says so
(``alloc_conf_same``): to compare like with like, run the whole benchmark with
``PYTORCH_ALLOC_CONF=expandable_segments:True``.

Offline and quiet: ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``,
``UNSLOTH_DISABLE_STATISTICS=1``, and ``UNSLOTH_COMPILE_LOCATION`` in a temporary folder (where Unsloth writes the
code it compiles). Importing this module imports nothing of Unsloth (nor torch's CUDA state).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .models import budget, has_mixers, is_moe, model_config, parse_layers
from .stacks import lora_targets, record_facts
from .stream import stream_batches
from .train import failed_steps, record, train_primed

ALLOC_CONF = "expandable_segments:True"  # Unsloth's own default
QUIET = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",
}
ROUTES = ("torch varlen_attn", "SDPA per run of equal-length documents", "dense packed mask")
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding the fastft package


def alloc_conf(env=None) -> str | None:
    """The allocator setting of the process whose environment is ``env`` (default this one's), or None."""
    env = os.environ if env is None else env
    return env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF")


def loader(name: str) -> str:
    """The Unsloth loader of the e2e model ``name``: ``FastModel`` for MoE models and models whose layers mix
    tokens outside attention, ``FastLanguageModel`` for the others (decided here: in the worker, transformers is
    Unsloth's patched one)."""
    return "FastModel" if is_moe(name) or has_mixers(name) else "FastLanguageModel"


def command(
    name: str,
    kind: str,
    tiny: bool,
    warmup: int,
    steps: int,
    out: str,
    device="cuda",
    quant: str | None = None,
    layers: int | str | None = None,
) -> list[str]:
    """The worker's command line: train ``warmup`` + ``steps`` steps of the e2e model ``name`` (``layers``: its
    decoder layers, ``fastft.e2e.models.layers_arg``) on stream ``kind`` and write the record to ``out`` (JSON)."""
    argv = [sys.executable, "-m", "fastft.e2e.unsloth", "--model", name, "--stream", kind, "--loader", loader(name)]
    argv += ["--warmup", str(warmup), "--steps", str(steps), "--device", str(device), "--json", out]
    if tiny:
        argv.append("--tiny")
    if quant is not None:
        argv += ["--quant", quant]
    if layers is not None:
        argv += ["--layers", str(layers)]
    return argv


def environment(compile_dir: str, base=None) -> dict:
    """The worker's environment: ``base`` (default this process's) kept offline and quiet (``QUIET``), Unsloth's
    compiled code in ``compile_dir``, the allocator setting ``base`` has or else ``ALLOC_CONF``, and the folder
    holding this fastft first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env.update(QUIET, UNSLOTH_COMPILE_LOCATION=compile_dir, PYTHONUNBUFFERED="1")
    env["FASTFT_PARENT_ALLOC_CONF"] = alloc_conf(env) or ""  # the other columns' setting ("": torch's default)
    env["PYTORCH_ALLOC_CONF"] = alloc_conf(env) or ALLOC_CONF
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, *(p for p in paths if p != _ROOT)])
    return env


def run_column(
    name: str,
    kind: str,
    column: str,
    device,
    tiny: bool,
    batches: list,
    warmup: int,
    quant: str | None = None,
    layers: int | str | None = None,
) -> dict:
    """The record of the ``unsloth`` column (see the module docstring): the worker trains on the stream's first
    ``len(batches)`` rows, ``batches`` here, checked to be the rows it trained on; a worker that fails gives a
    record of NaN steps with its ``error`` (its output above says why)."""
    steps = len(batches) - warmup
    with tempfile.TemporaryDirectory(prefix="fastft-unsloth-") as tmp:
        out = os.path.join(tmp, "record.json")
        argv = command(name, kind, tiny, warmup, steps, out, device, quant, layers)
        env = environment(os.path.join(tmp, "compiled"))
        print(f"unsloth column: {' '.join(argv)} (PYTORCH_ALLOC_CONF={env['PYTORCH_ALLOC_CONF']})", flush=True)
        sys.stderr.flush()
        # its stdout and stderr are this process's; what it writes beside itself goes to the temporary folder
        status = subprocess.run(argv, env=env, cwd=tmp).returncode
        if status == 0 and os.path.exists(out):
            with open(out) as f:
                written = json.load(f)
            expected = [b.num_tokens for b in batches]
            if written.get("row_tokens") != expected:
                raise RuntimeError(
                    f"the unsloth worker trained on other rows: {written.get('row_tokens')} != {expected}"
                )
            return written
    facts = record_facts(column, name, tiny, layers)
    failed = record(
        name,
        kind,
        column,
        batches,
        warmup,
        failed_steps(len(batches)),
        dtype="bfloat16",
        lora=True,
        quant=quant,
        **facts,
    )
    return {**failed, "error": f"the unsloth worker exited with status {status} (its output above says why)"}


def save_model(model, folder: str) -> None:
    """``model`` (a transformers causal LM) saved to ``folder`` with a small word-level tokenizer (``tokenizer``),
    so that loaders that need one there (Unsloth's) find it without going to the hub. The weights keep the model's
    own layout: reverting a MoE model's fused experts to per-expert checkpoint names copies the whole state dict at
    once, on the weights' device (out of memory for Qwen3-30B-A3B on an 80 GB GPU)."""
    model.save_pretrained(folder, save_original_format=False)
    tokenizer().save_pretrained(folder)


def tokenizer():
    """A ``PreTrainedTokenizerFast`` built here, no download: a word-level vocabulary of four special tokens and
    ``word0``... up to 256 ids; the benchmark feeds token ids, never text."""
    import tokenizers
    import transformers

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"word{i}" for i in range(256 - len(specials))])}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    fast = tokenizers.Tokenizer(model)
    fast.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=fast, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@contextlib.contextmanager
def _counting_routes(counts: dict):
    """Counts the packed attention calls that take each of Unsloth's routes (``ROUTES``; calls made in Python:
    a compiled caller's replays are not seen)."""
    try:
        from unsloth.utils import attention_dispatch as ad
    except ImportError:  # its CPU fallback (no GPU) loads none of this
        yield
        return
    names = {"_torch_varlen_packed": ROUTES[0], "_sdpa_packed_segments": ROUTES[1]}
    names["build_sdpa_packed_attention_mask"] = ROUTES[2]
    saved = {n: getattr(ad, n) for n in names if hasattr(ad, n)}

    def wrap(fn, route):
        def counted(*args, **kwargs):
            out = fn(*args, **kwargs)
            if out is not None:  # the per-run path returns None where it does not apply
                counts[route] = counts.get(route, 0) + 1
            return out

        return counted

    for n, fn in saved.items():
        setattr(ad, n, wrap(fn, names[n]))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(ad, n, fn)


def _backend(counts: dict) -> str:
    """What attention path Unsloth chose for packed rows (its flags), and the counted routes."""
    try:
        from unsloth.utils import attention_dispatch as ad
    except ImportError as e:  # its CPU fallback (no GPU) loads none of this
        return f"unknown (unsloth.utils.attention_dispatch: {e})"
    chosen = ad.select_attention_backend(use_varlen=True)
    flags = (
        f"flash-attn {'yes' if getattr(ad, 'HAS_FLASH_ATTENTION', False) else 'no'}, "
        f"xformers {'yes' if getattr(ad, 'HAS_XFORMERS', False) else 'no'}, "
        f"torch varlen_attn {'yes' if getattr(ad, '_TORCH_VARLEN_ATTN', None) is not None else 'no'}"
    )
    seen = ", ".join(f"{r} {counts[r]}" for r in ROUTES if counts.get(r)) or "no packed call seen in Python"
    return f"{chosen} ({flags}; calls: {seen})"


def on_fallback(row: dict) -> bool:
    """Whether the ``unsloth`` record ``row`` ran Unsloth's packed attention without either of the varlen kernels
    its users run it with (flash-attn's, xformers'): torch's SDPA per run of equal-length documents."""
    backend = row.get("backend") or ""
    return "flash-attn no" in backend and "xformers no" in backend


def _moe_backend() -> str | None:
    try:
        from unsloth_zoo.temporary_patches.moe_utils import select_moe_backend
    except ImportError:
        return os.environ.get("UNSLOTH_MOE_BACKEND")
    return select_moe_backend()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastft.e2e.unsloth", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--stream", required=True)
    p.add_argument("--loader", choices=("FastLanguageModel", "FastModel"), required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--quant", choices=("nf4",))
    p.add_argument("--layers", type=parse_layers)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    for key, value in QUIET.items():
        os.environ.setdefault(key, value)

    import unsloth  # first: it patches transformers, peft and trl
    from unsloth import FastLanguageModel, FastModel

    # isort: split
    import transformers

    name, device, tiny = args.model, torch.device(args.device), args.tiny
    quant, layers = args.quant, args.layers
    loader = FastModel if args.loader == "FastModel" else FastLanguageModel
    if args.loader == "FastModel":
        try:
            from unsloth.utils.hf_packed_attention import enable_hf_packed_attention
        except ImportError as e:  # Unsloth's CPU fallback (no GPU) loads none of unsloth.models
            print(f"unsloth column: no enable_hf_packed_attention ({e})", flush=True)
        else:
            print(f"unsloth column: enable_hf_packed_attention() -> {enable_hf_packed_attention()}", flush=True)
    torch.manual_seed(0)  # the weights of every column (fastft.e2e.stacks.build)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(model_config(name, tiny, layers), dtype=torch.bfloat16)
    targets = lora_targets(model, name)
    with tempfile.TemporaryDirectory(prefix="fastft-unsloth-model-") as folder:
        save_model(model, folder)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model, _ = loader.from_pretrained(
            folder,
            max_seq_length=budget(name, tiny),
            dtype=torch.bfloat16,
            load_in_4bit=quant == "nf4",
            load_in_16bit=quant is None,
            local_files_only=True,
            use_exact_model_name=True,
        )
    model = loader.get_peft_model(
        model,
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        bias="none",
        target_modules=targets,
        use_gradient_checkpointing="unsloth",
        random_state=0,
    )
    model.train()
    dtype = str(next(model.parameters()).dtype).split(".")[-1]
    batches = stream_batches(name, args.stream, tiny, args.warmup + args.steps, device)
    inputs = [{**b.inputs(), "packed_seq_lengths": torch.tensor(b.seq_lengths, dtype=torch.int32)} for b in batches]
    counts: dict = {}
    print(f"unsloth {unsloth.__version__}: {type(model).__name__}, LoRA on {', '.join(targets)}", flush=True)
    with _counting_routes(counts):
        try:
            result = train_primed(model, inputs, args.warmup, device)
        except torch.OutOfMemoryError:
            result = failed_steps(len(batches))
    facts = record_facts("unsloth", name, tiny, layers)
    row = record(
        name, args.stream, "unsloth", batches, args.warmup, result, dtype=dtype, lora=True, quant=quant, **facts
    )
    setting = os.environ.get("PYTORCH_ALLOC_CONF")
    row.update(
        backend=_backend(counts),
        moe_backend=_moe_backend() if is_moe(name) else None,
        unsloth=unsloth.__version__,
        alloc_conf=setting,
        alloc_conf_same=setting == os.environ.get("FASTFT_PARENT_ALLOC_CONF", ""),
        row_tokens=[b.num_tokens for b in batches],
    )
    if not all(map(math.isfinite, row["losses"])):
        row["error"] = "out of memory" if result.peak_bytes < 0 else "a loss is not finite"
    with open(args.json, "w") as f:
        json.dump(row, f)
    print(f"unsloth column: backend {row['backend']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
