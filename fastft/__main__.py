"""fastft's command line: python -m fastft COMMAND [options] (or fastft COMMAND).

commands:
  info    the device, versions, and the backend and autotune entry of every op
  check   differential fuzzing: the selfcheck ops' Triton paths against their torch references
  bench   each op's baseline against fastft (the op micro-benchmarks)
  e2e     the main job: fine-tuning steps of transformers models per stack, and fastft's loss check
  audit   profile e2e training steps: launches, host syncs, GPU-busy fraction, why the GPU idled, per layer
  tune    measure launch parameters on this GPU and rewrite autotune_cache/<arch>.json

Run python -m fastft COMMAND --help for a command's options. Without a GPU, check and bench run the Triton
kernels in Triton's interpreter at small sizes, e2e and audit fastft's torch paths (--backend triton: the
interpreter); every command says what ran.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import time

import torch

from fastft import autotune, bench, capabilities, cli, dispatch


def cmd_info(args) -> int:
    device = cli.device_of(args.device)
    print(f"device: {cli.describe(device)}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in cli.versions().items()))
    print(
        f"FASTFT_BACKEND={dispatch.requested_backend()}  TRITON_INTERPRET={'1' if capabilities.interpreting() else '0'}"
    )
    path = autotune.cache_path(capabilities.arch(device))
    if device.type != "cuda":
        print(f"autotune cache: none on a CPU (each op's default launch parameters; {path.parent} holds GPUs' files)")
    else:
        print(f"autotune cache: {path}" + ("" if path.exists() else " (absent: each op's default launch parameters)"))
    for op in sorted(dispatch.OPS):
        _, hit = autotune.lookup(op, device, 16384)
        print(f"  {op:28s} backend={dispatch.backend_for(op, device)}  autotune={'hit' if hit else 'defaults'}")
    if device.type != "cuda" and not capabilities.interpreting():
        print(
            "on a CPU fastft runs its torch paths; TRITON_INTERPRET=1 runs its Triton kernels in Triton's "
            f"interpreter ({cli.prog()} check and bench do)"
        )
    return 0


def cmd_check(args) -> int:
    from fastft import selfcheck

    device = cli.device_of(args.device)
    max_tokens = args.max_tokens if args.max_tokens is not None else (2048 if device.type == "cuda" else 96)
    g = torch.Generator().manual_seed(args.seed if args.seed is not None else int(time.time_ns() % 2**62))
    print(
        f"check on {cli.describe(device)}: triton vs torch, up to {max_tokens} tokens, {args.seconds}s, "
        f"seed {g.initial_seed()}"
    )
    runs, failures = collections.Counter(), collections.Counter()
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline or not runs:
        for name, check in selfcheck.CHECKS.items():
            runs[name] += 1
            try:
                check(g, device, max_tokens)
            except AssertionError as e:
                failures[name] += 1
                print(f"MISMATCH in {name}: {e}")
    for name in selfcheck.CHECKS:
        print(f"  {name:20s} {runs[name]:4d} cases, {failures[name]} failures")
    print(f"{sum(runs.values())} cases, {sum(failures.values())} failures")
    return 1 if failures else 0


def cmd_bench(args) -> int:
    from fastft.bench import common

    device = cli.device_of(args.device)
    quick = args.quick or device.type != "cuda"
    print(
        f"bench on {cli.describe(device)}"
        + ("  [CPU: small sizes, numbers not representative]" if device.type != "cuda" else "")
    )
    rows = []
    for module in bench.modules(args.only).values():
        rows += module.run(device, quick)
    print(common.format_table(rows))
    if args.json:
        cli.write_json(args.json, device, [dict(r.__dict__, speedup=r.speedup) for r in rows])
    return 0


def cmd_tune(args) -> int:
    from fastft.bench import common

    device = cli.device_of(args.device)
    if device.type != "cuda":
        print("tune measures launch parameters on a GPU; no CUDA device here", file=sys.stderr)
        return 2
    results: dict = {}
    path = autotune.cache_path(capabilities.arch(device))
    if args.only and path.exists():  # keep the other ops' measured entries
        results = json.loads(path.read_text()).get("ops", {})
    launchers = {}
    for module in bench.modules(args.only or bench.tuned()).values():
        launchers.update(module.tune_launchers(device))
    for op, tunable in autotune.TUNABLES.items():
        if op not in launchers:
            continue  # another family (--only), or nothing to tune (no grid)
        results[op] = {}
        for size in tunable.sizes:
            launch = launchers[op](size)
            candidates = tunable.candidates()
            # CUDA-graph replays: the kernels' device time, not the host's launch cost
            timed = [(common.graph_ms(lambda: launch(cfg), rep_ms=50), cfg) for cfg in candidates]
            best_ms, best = min(timed, key=lambda x: x[0])
            results[op][str(autotune.bucket(size))] = best
            print(f"{op:28s} size={size:8d} best {best} {best_ms:.4f} ms (of {len(candidates)})")
    meta = {
        "device": torch.cuda.get_device_name(device),
        "date": datetime.date.today().isoformat(),
        "versions": cli.versions(),
    }
    print(f"wrote {autotune.write(capabilities.arch(device), results, meta)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fastft.e2e import command as e2e

    intro, _, rest = __doc__.split("\n\n", 2)  # the commands' list is argparse's own
    parser = argparse.ArgumentParser(
        prog=cli.prog(), description=f"{intro}\n\n{rest}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True, title="commands", metavar="COMMAND")

    p = sub.add_parser("info", help="device, versions, backend and autotune entry per op")
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("check", help="differential fuzz: triton vs torch on random inputs")
    p.add_argument("--seconds", type=cli.positive(float), default=10.0, help="how long to draw cases (default 10)")
    p.add_argument("--seed", type=int, help="generator seed (default: drawn and printed)")
    p.add_argument(
        "--max-tokens", type=cli.positive(int), help="largest token count drawn (default 2048 on a GPU, 96 on a CPU)"
    )
    p.set_defaults(fn=cmd_check, interpreter=True)

    p = sub.add_parser(
        "bench",
        help="the op micro-benchmarks: baseline vs fastft, median times and ratios",
        description="Each op's baseline against fastft: median times, speedup = baseline ms / fastft ms. The main "
        f"job (fine-tuning steps of transformers models) is {cli.prog()} e2e.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes (always on without a GPU)")
    p.add_argument("--only", action="append", choices=list(bench.FAMILIES), help="only these op families (repeatable)")
    p.add_argument("--json", type=cli.json_path, help="also write the results to this file")
    p.set_defaults(fn=cmd_bench, interpreter=True)

    e2e.add_parsers(sub)

    p = sub.add_parser("tune", help="measure launch parameters and rewrite autotune_cache/<arch>.json")
    p.add_argument("--only", action="append", choices=list(bench.tuned()), help="only these op families (repeatable)")
    p.set_defaults(fn=cmd_tune)

    for p in sub.choices.values():
        p.add_argument("--device", type=cli.device_arg, help="torch device (default: cuda if available, else cpu)")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv[:1] == ["bench"] and "--e2e" in argv:
        parser.error(f"bench --e2e is now its own command: {cli.prog()} e2e (see {cli.prog()} e2e --help)")
    args = parser.parse_args(argv)
    if getattr(args, "interpreter", False):  # check and bench run the Triton kernels, in the interpreter on a CPU
        with cli.environment(**cli.interpreter_on_cpu(cli.device_of(args.device))):
            return args.fn(args)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
