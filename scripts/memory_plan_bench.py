"""Memory plan on a GPU: Qwen3-8B widths (random weights from the config, no download), N layers, PEFT LoRA
r=16 on every linear, ``fastft.integrations.transformers.apply``, a padding-free stream of fresh packed rows of
up to ``--tokens`` tokens. Compares full recompute (apply's default checkpointing), the memory plan
(``apply(model, memory_budget=..., max_tokens=--tokens)``) and no checkpoint (where it fits): tokens/s and peak
memory over ``--steps`` timed steps after ``--warmup`` (the plan is in force from the second step), each
configuration in its own process; and the compute floor: the step's model FLOPs (forward and input gradient of
every GEMM, the LoRA adapters' weight gradients, the head; causal attention forward and backward without its
recomputation; no layer recomputation) at the measured rate of a dense bf16 GEMM of the model's largest shape.

    PYTHONPATH=$PWD python3 scripts/memory_plan_bench.py --layers 8 [--budget auto] [--out result.json]

Prints one line per configuration, the plan's table, and each configuration's per-step losses beside full
recompute's (the same weights and rows: a plan computes what full recompute does, within bf16 kernels'
run-to-run differences). Needs torch, transformers, peft and a CUDA GPU. The compute floor is the main job's
(``fastft.e2e.floor``: its LoRA targets on a dense model are every linear of the layers, as here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from fastft.e2e.floor import gemm_rate, step_flops
from fastft.e2e.models import MODEL_CONFIGS

QWEN3_8B = {k: v for k, v in MODEL_CONFIGS["Qwen3-8B"][1].items() if k != "num_hidden_layers"}  # the main job's widths
CONFIGS = ("recompute", "plan", "none")
RANK = 16
GIB = 2**30


def stream(steps: int, max_tokens: int, vocab: int, seed: int, device) -> list:
    """Packed rows of documents (lengths uniform in [64, 4096]) filled greedily up to ``max_tokens``."""
    g = torch.Generator().manual_seed(seed)
    rows, pending = [], int(torch.randint(64, 4097, (), generator=g))
    for _ in range(steps):
        lengths = []
        while sum(lengths) + pending <= max_tokens:
            lengths.append(pending)
            pending = int(torch.randint(64, 4097, (), generator=g))
        n = sum(lengths)
        ids = torch.randint(0, vocab, (1, n), generator=g)
        pos = torch.cat([torch.arange(k) for k in lengths])[None]
        rows.append(dict(input_ids=ids.to(device), labels=ids.to(device), position_ids=pos.to(device), lengths=lengths))
    return rows


def run(args) -> dict:
    """One configuration, in this process."""
    import peft
    import transformers

    from fastft.integrations.transformers import apply, memory_plan

    device = torch.device("cuda")
    config = transformers.Qwen3Config(num_hidden_layers=args.layers, **QWEN3_8B)
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=32, target_modules="all-linear"))
    model.train()
    if args.run == "recompute":
        apply(model)
    elif args.run == "plan":
        budget = args.budget
        if budget != "auto":
            budget = float(budget) if "." in budget else int(budget)
        apply(model, memory_budget=budget, max_tokens=args.tokens)
    else:
        apply(model, offload_checkpointing=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = stream(args.warmup + args.steps, args.tokens, config.vocab_size, 1, device)
    losses, seconds, tokens = [], 0.0, 0
    try:
        for n, row in enumerate(rows):
            if n == args.warmup:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            loss = model(**{k: v for k, v in row.items() if k != "lengths"}).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))  # syncs: the step is done
            if n >= args.warmup:
                seconds += time.perf_counter() - start
                tokens += len(row["input_ids"][0])
    except torch.cuda.OutOfMemoryError:
        return {"config": args.run, "oom": True}
    timed = rows[args.warmup :]
    flops = sum(step_flops("Qwen3-8B", row["lengths"], args.layers) for row in timed)
    plan = memory_plan(model)
    return {
        "config": args.run,
        "oom": False,
        "tokens_per_s": tokens / seconds,
        "step_ms": 1e3 * seconds / len(timed),
        "peak_gib": torch.cuda.max_memory_allocated() / GIB,
        "reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "model_tflops": flops / seconds / 1e12,
        "losses": losses,
        "plan": None if plan is None else str(plan),
        "plan_counts": None if plan is None else plan.counts(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="each row's token budget (the plan's max_tokens)")
    p.add_argument("--budget", default="auto", help="memory_budget: 'auto', bytes (int) or a fraction (float)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--run", choices=CONFIGS, default=None, help=argparse.SUPPRESS)  # one configuration, in-process
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_plan_bench.py needs a CUDA GPU")
    if args.warmup < 2:
        raise SystemExit("--warmup must be at least 2: the plan is made at the second step")
    if args.run:
        print(json.dumps(run(args)))
        return
    results = []
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--run", name] + [
            f"--{k}={v}" for k, v in vars(args).items() if k in ("layers", "tokens", "budget", "steps", "warmup")
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            results.append({"config": name, "error": done.returncode})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    rate = gemm_rate(torch.device("cuda"), args.tokens, QWEN3_8B["hidden_size"], QWEN3_8B["intermediate_size"])
    rows = stream(args.warmup + args.steps, args.tokens, QWEN3_8B["vocab_size"], 1, "cpu")[args.warmup :]
    flops = sum(step_flops("Qwen3-8B", row["lengths"], args.layers) for row in rows)
    tokens = sum(sum(row["lengths"]) for row in rows)
    floor = tokens / (flops / rate)
    print(f"{torch.cuda.get_device_name()}, Qwen3-8B widths, {args.layers} layers, LoRA r={RANK} on every linear, ")
    print(f"rows of up to {args.tokens} tokens, {args.steps} timed steps after {args.warmup}; budget {args.budget}")
    print(f"dense bf16 GEMM [{args.tokens}, 4096] x [4096, 12288]: {rate / 1e12:.0f} TFLOP/s; ")
    print(f"compute floor (model FLOPs at that rate): {floor:,.0f} tokens/s")
    print(f"{'config':<10} {'tokens/s':>10} {'step ms':>9} {'peak GiB':>9} {'of floor':>9}  plan")
    for r in results:
        if r.get("error") or r.get("oom"):
            print(f"{r['config']:<10} {'OOM' if r.get('oom') else 'failed (rc ' + str(r['error']) + ')'}")
            continue
        counts = ", ".join(f"{k} {v}" for k, v in (r["plan_counts"] or {}).items() if v)
        print(
            f"{r['config']:<10} {r['tokens_per_s']:>10,.0f} {r['step_ms']:>9.1f} {r['peak_gib']:>9.2f} "
            f"{r['tokens_per_s'] / floor:>9.1%}  {counts}"
        )
    base = next((r for r in results if r["config"] == "recompute" and "losses" in r), None)
    for r in results:
        if r.get("plan"):
            print(r["plan"])
        if base is not None and "losses" in r and r is not base:
            diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
            print(f"{r['config']}: largest per-step loss difference from full recompute {diff:.3g}")
    if args.out:
        with open(args.out, "w") as f:
            summary = {"args": vars(args), "gemm_tflops": rate / 1e12, "floor_tokens_per_s": floor}
            json.dump({**summary, "results": results}, f)


if __name__ == "__main__":
    main()
