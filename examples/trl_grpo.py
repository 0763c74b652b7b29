"""Reinforcement learning with TRL's GRPOTrainer and fastft: the policy generates (``model.generate``, no vLLM),
its completions are scored, and it trains on them. The same policy runs twice, without and with fastft, on
the same prompts and seeds; the script checks that the first step's completions are the same tokens (fastft
steps aside in generation), that the losses and gradient norms agree, and that fastft's pieces are still on
after training. The reward is the share of words with an even number.

    python examples/trl_grpo.py              # a tiny Qwen3 with LoRA and a word-level tokenizer, CPU or GPU
    python examples/trl_grpo.py --steps 4

With a real checkpoint, pass its model and tokenizer instead of ``tiny_model`` and ``tiny_tokenizer``; the
fastft part is the one ``apply`` line.
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
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins the words with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.padding_side = "left"
    return tokenizer


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
    )
    torch.manual_seed(0)  # the same weights and LoRA initialisation for both runs
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(model, lora)


def prompts(count: int, seed: int = 0) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (count,), generator=g).tolist()
    return datasets.Dataset.from_dict(
        {"prompt": [" ".join(WORDS[i] for i in torch.randint(0, 250, (n,), generator=g).tolist()) for n in lengths]}
    )


def train(model, tokenizer, data, steps: int, device: str) -> tuple[list[float], list[list[str]]]:
    """((loss, gradient norm) per step, the completions of each generation) of GRPO on ``data``."""
    losses, generated = [], []

    def reward(completions, **kwargs):
        generated.append(list(completions))
        return [sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit()) / 8 for c in completions]

    class LossLog(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append((logs["loss"], logs["grad_norm"]))

    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            learning_rate=1e-2,
            logging_steps=1,
            seed=0,
            bf16=device == "cuda",
            use_cpu=device == "cpu",
            gradient_checkpointing=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[LossLog()],
        )
        trainer.train()
    return losses, generated


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run (default 2)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()
    tokenizer = tiny_tokenizer()
    data = prompts(4 * args.steps)
    stock_losses, stock_completions = train(tiny_model(args.device), tokenizer, data, args.steps, args.device)
    model = apply(tiny_model(args.device))  # packed attention, offloaded checkpointing, fastft's LoRA path
    losses, completions = train(model, tokenizer, data, args.steps, args.device)
    tol = 2e-2 if args.device == "cuda" else 1e-4
    same_tokens = bool(completions) and completions[0] == stock_completions[0]
    same_losses = len(losses) == len(stock_losses) == args.steps and all(
        abs(a - b) <= tol * max(abs(a), 1e-3) for pair in zip(stock_losses, losses) for a, b in zip(*pair)
    )
    trained = all(norm > 0 for _, norm in losses)
    print(f"first completions: {completions[0][:2]} ...")
    print(f"stock (loss, grad norm) {stock_losses}")
    print(f"fastft (loss, grad norm) {losses}")
    print(f"the first step's completions are the same tokens: {same_tokens}")
    print(f"losses and gradient norms agree (relative {tol:g}): {same_losses}; gradients are not zero: {trained}")
    return 0 if same_tokens and same_losses and trained else 1


if __name__ == "__main__":
    raise SystemExit(main())
