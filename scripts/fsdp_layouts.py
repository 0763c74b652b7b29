"""Data-parallel layouts of an ``apply``'d model, timed on a stream of fresh packed batches: DDP, FSDP2 as
``fully_shard`` gives it, and ``fastft.integrations.fsdp.shard``'s layouts. Per rank: the mean step time of
``--steps`` timed steps after ``--warmup`` (each step a new packed row per rank, forward + backward + AdamW),
tokens/s per GPU and the peak GPU memory. Random weights from the model's config (no download).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/fsdp_layouts.py            # LoRA, every mode
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 scripts/fsdp_layouts.py            # one GPU: the scaling base
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/fsdp_layouts.py --full     # full fine-tuning
    ... --stock     # transformers' own attention and checkpointing instead of fastft's (apply not called)
    torchrun --nproc-per-node 2 scripts/fsdp_layouts.py --tiny --steps 2     # a smoke test (CPUs: gloo)

Modes (``--mode``, repeatable; default all):
- ``ddp``: ``DistributedDataParallel`` (LoRA: only the adapters are reduced);
- ``fsdp2``: ``fully_shard`` on each decoder layer and the root, FSDP2's defaults (every parameter sharded,
  resharded after forward, implicit prefetch);
- ``shard``: ``shard(model)`` (LoRA: the frozen base whole on every rank, the adapters sharded in one unit and
  kept gathered from forward to backward; full fine-tuning: as ``shard-full``);
- ``shard-full``: ``shard(model, layout="full")``: every parameter sharded, one layer prefetched;
- ``shard-full-keep``: ``shard(model, layout="full", reshard_after_forward=False)``.
Every FSDP2 mode runs bf16 parameters with fp32 gradient reduction (``MixedPrecisionPolicy``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time

import torch
import torch.distributed as dist

from fastft.e2e.models import MODEL_CONFIGS

LLAMA_1B = dict(MODEL_CONFIGS["Llama-3.2-1B"][1])  # the main job's Llama-3.2-1B widths
TINY = dict(
    LLAMA_1B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)
MODES = ("ddp", "fsdp2", "shard", "shard-full", "shard-full-keep")


def packed_batch(step: int, rank: int, tokens: int, vocab: int, device) -> dict:
    """A fresh packed row of exactly ``tokens`` tokens: documents of SFT-like lengths (lognormal, 32 to 4096)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    lengths, total = [], 0
    while total < tokens:
        n = int(torch.empty(()).log_normal_(6.0, 1.0, generator=g).clamp(32, 4096))
        n = min(n, tokens - total)
        lengths.append(n)
        total += n
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {
        k: v.to(device, non_blocking=True) for k, v in dict(input_ids=ids, labels=ids, position_ids=positions).items()
    }


def build(args, device):
    import transformers

    torch.manual_seed(0)  # the same weights on every rank
    config = transformers.LlamaConfig(**(TINY if args.tiny else LLAMA_1B), use_cache=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).train()
    if not args.full:
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets)
        )
    if args.stock:
        model.gradient_checkpointing_enable({"use_reentrant": False})
        return model
    import fastft.integrations.transformers as ft_hf

    return ft_hf.apply(model)


def wrap(model, mode: str, device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fastft.integrations.fsdp import shard
    from fastft.integrations.transformers import decoder_layers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "fsdp2":
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    layout = "full" if mode.startswith("shard-full") else "auto"
    keep = False if mode == "shard-full-keep" else None
    return shard(model, layout=layout, reshard_after_forward=keep, mp_policy=policy)


def run_mode(args, mode: str, device, rank: int, world: int) -> dict:
    model = build(args, device)
    wrapped = wrap(model, mode, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    vocab = model.config.get_text_config().vocab_size
    cuda = device.type == "cuda"

    def step(i):
        loss = wrapped(**packed_batch(i, rank, args.tokens, vocab, device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(args.warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        start = time.perf_counter()
        step(i)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    result = dict(
        mode=mode,
        rank=rank,
        world=world,
        step_ms=1000 * sum(times) / len(times),
        tokens_per_s=args.tokens * len(times) / sum(times),
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", action="append", choices=MODES, help="repeatable; default: every mode")
    parser.add_argument("--full", action="store_true", help="full fine-tuning (default: LoRA on every linear)")
    parser.add_argument("--stock", action="store_true", help="without fastft: transformers' attention and checkpoint")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, 256 tokens (smoke test; CPUs: gloo)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per rank and step (one packed row)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (>= 20 for the reported numbers)")
    parser.add_argument("--json", help="write every rank's results here (rank 0)")
    args = parser.parse_args()
    if args.tiny:
        args.tokens = min(args.tokens, 256)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=600)
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for mode in args.mode or MODES:
        result = run_mode(args, mode, device, rank, world)
        gc.collect()  # the mode's model and optimizer state go before the next mode's
        if device.type == "cuda":
            torch.cuda.empty_cache()
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        rows.extend(gathered)
        if rank == 0:
            slowest = max(r["step_ms"] for r in gathered)
            print(
                f"{mode:16s} world {world}  step {slowest:8.1f} ms (slowest rank)  "
                f"{args.tokens * 1000 / slowest:9.0f} tokens/s/GPU  "
                + "  ".join(f"rank {r['rank']}: {r['step_ms']:.1f} ms {r['peak_gib']:.2f} GiB" for r in gathered),
                flush=True,
            )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
