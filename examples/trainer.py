"""Fine-tune with transformers' Trainer and fastft: padding-free batches, Trainer's own gradient checkpointing,
PEFT LoRA. Trains the same model on the same batches twice, with stock attention and with fastft, and checks
that the losses agree step by step and that no document saw another.

    python examples/trainer.py                 # a tiny Llama on the CPU (or the GPU, when there is one)
    python examples/trainer.py --steps 20

With a real checkpoint, build the model with ``from_pretrained`` instead of ``tiny_model``; the fastft part
is the one ``apply`` line.
"""

from __future__ import annotations

import argparse
import tempfile

import peft
import torch
import transformers

from fastft.integrations.transformers import apply


def tiny_model(device: str) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_cache=False,
    )
    torch.manual_seed(0)  # the same weights and LoRA initialisation for both runs
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(model, lora)


def documents(count: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (count,), generator=g)
    return [{"input_ids": torch.randint(1, 256, (int(n),), generator=g).tolist()} for n in lengths]


class LossLog(transformers.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def train(model, rows, steps: int, device: str) -> list[float]:
    log = LossLog()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            logging_steps=1,
            gradient_checkpointing=True,  # Trainer turns it on again itself; fastft's offload stays
            bf16=device == "cuda",
            use_cpu=device == "cpu",
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        collate = transformers.DataCollatorWithFlattening()  # one row per batch, position ids restart per document
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[log]
        )
        trainer.train()
    return log.losses


def documents_stay_apart(model, rows, device: str) -> bool:
    """The packed row's logits equal each document's logits alone."""
    batch = transformers.DataCollatorWithFlattening()(rows[:4])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device)).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([r["input_ids"]], device=device)).logits[0] for r in rows[:4]])
    tol = 3e-2 if packed.dtype == torch.bfloat16 else 1e-4
    return torch.allclose(packed, alone, atol=tol, rtol=tol)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default 4)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    rows = documents(8 * args.steps)

    stock = train(tiny_model(args.device), rows, args.steps, args.device)
    model = apply(tiny_model(args.device))  # packed attention, offloaded checkpointing, fastft's LoRA path
    ours = train(model, rows, args.steps, args.device)

    tol = 2e-2 if args.device == "cuda" else 1e-4
    print("step  stock     fastft")
    for i, (a, b) in enumerate(zip(stock, ours), 1):
        print(f"{i:4d}  {a:.4f}  {b:.4f}")
    same = len(stock) == len(ours) == args.steps and all(abs(a - b) <= tol * abs(a) for a, b in zip(stock, ours))
    apart = documents_stay_apart(model, rows, args.device)
    print(f"losses agree (relative {tol:g}): {same}; documents never mixed: {apart}")
    return 0 if same and apart else 1


if __name__ == "__main__":
    raise SystemExit(main())
