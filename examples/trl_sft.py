"""Fine-tune with TRL's SFTTrainer and fastft, padding-free (``padding_free=True``) and packed
(``packing=True``, best-fit decreasing). Each mode trains the same model on the same batches twice, with
stock attention and with fastft, and checks that the losses agree step by step and that no document saw
another.

    python examples/trl_sft.py                 # a tiny Qwen3 and a word-level tokenizer, CPU or GPU
    python examples/trl_sft.py --mode packing --steps 10

With a real checkpoint, pass its model and tokenizer instead of ``tiny_model`` and ``tiny_tokenizer``; the
fastft part is the one ``apply`` line. TRL's collator hands the model ``position_ids`` and flash-attention
style ``cu_seq_lens_q``/``max_length_q``; fastft's attention builds its document boundaries from them once
per forward, without a host sync.
"""

from __future__ import annotations

import argparse
import tempfile

import datasets
import peft
import tokenizers
import torch
import transformers
import trl

from fastft.integrations.transformers import apply

WORDS = [f"w{i}" for i in range(250)]


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_model(device: str) -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        eos_token_id=1,
        use_cache=False,
    )
    torch.manual_seed(0)  # the same weights and LoRA initialisation for both runs
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(model, lora)


def text_dataset(count: int, seed: int = 0) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (count,), generator=g).tolist()
    return datasets.Dataset.from_dict(
        {"text": [" ".join(WORDS[i] for i in torch.randint(0, 250, (n,), generator=g).tolist()) for n in lengths]}
    )


def train(model, tokenizer, data, mode: str, steps: int, device: str) -> tuple[list[float], dict]:
    """(loss per step, one training batch as the collator made it)."""
    losses = []

    class LossLog(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as out:
        config = trl.SFTConfig(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            logging_steps=1,
            padding_free=mode == "padding_free",
            packing=mode == "packing",
            max_length=128 if mode == "packing" else None,  # padding-free: documents are short already
            bf16=device == "cuda",  # SFTConfig's gradient_checkpointing=True default stays on: fastft's offload stays
            use_cpu=device == "cpu",
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = trl.SFTTrainer(
            model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[LossLog()]
        )
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.train()
    return losses, batch


def documents_stay_apart(model, batch, device: str) -> bool:
    """The collated row's logits equal each of its documents' logits alone."""
    ids, positions = batch["input_ids"].to(device), batch["position_ids"].to(device)
    starts = (positions[0] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0]
        alone = torch.cat([model(input_ids=ids[:, a:b]).logits[0] for a, b in zip(starts, starts[1:])])
    tol = 3e-2 if packed.dtype == torch.bfloat16 else 1e-4
    return len(starts) > 2 and torch.allclose(packed, alone, atol=tol, rtol=tol)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["padding_free", "packing", "both"], default="both", help="default both")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()
    tokenizer = tiny_tokenizer()
    data = text_dataset(16 * args.steps)
    tol = 2e-2 if args.device == "cuda" else 1e-4
    ok = True
    for mode in ["padding_free", "packing"] if args.mode == "both" else [args.mode]:
        stock, _ = train(tiny_model(args.device), tokenizer, data, mode, args.steps, args.device)
        model = apply(tiny_model(args.device))  # packed attention, offloaded checkpointing, fastft's LoRA path
        ours, batch = train(model, tokenizer, data, mode, args.steps, args.device)
        same = len(stock) == len(ours) == args.steps and all(abs(a - b) <= tol * abs(a) for a, b in zip(stock, ours))
        apart = documents_stay_apart(model, batch, args.device)
        print(f"{mode}: stock {[round(x, 4) for x in stock]}, fastft {[round(x, 4) for x in ours]}")
        print(f"{mode}: losses agree (relative {tol:g}): {same}; documents never mixed: {apart}")
        ok &= same and apart
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
