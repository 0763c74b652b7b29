"""fastft's command line: python -m fastft COMMAND [options] (or fastft COMMAND).

commands:
  info    the device, versions, and the backend and autotune entry of every op
  check   differential fuzzing: each op's Triton path against its torch reference on random inputs
  bench   each op's baseline against fastft; with --e2e, fine-tuning steps of transformers models
  audit   profile e2e training steps: launches, host syncs, GPU-busy fraction, why the GPU idled, per layer
  tune    measure launch parameters on this GPU and rewrite autotune_cache/<arch>.json

Run python -m fastft COMMAND --help for a command's options. Without a GPU, the Triton kernels run in
Triton's interpreter (TRITON_INTERPRET=1 is set before anything imports Triton) at small sizes, and every
command says which backend ran.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fastft  # noqa: E402
from fastft import autotune, capabilities, dispatch  # noqa: E402


def _device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def _device_arg(name: str) -> str:
    """argparse type of --device: a torch device that exists here."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"not a torch device: {name!r} ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name}: this torch sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{name}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{name}: fastft's CLI runs on cpu or cuda devices")
    return name


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "fastft": fastft.__version__,
    }


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({capabilities.arch(device)})"
    return f"{platform.processor() or platform.machine()} CPU" + (
        " (Triton interpreter)" if capabilities.interpreting() else ""
    )


def cmd_info(args) -> int:
    device = _device(args.device)
    print(f"device: {_describe(device)}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in _versions().items()))
    print(
        f"FASTFT_BACKEND={os.environ.get('FASTFT_BACKEND', 'auto')}  "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )
    print(f"autotune cache: {autotune.cache_path(capabilities.arch(device))}")
    for op in sorted(dispatch.OPS):
        _, hit = autotune.lookup(op, device, 16384)
        print(f"  {op:28s} backend={dispatch.backend_for(op, device)}  autotune={'hit' if hit else 'defaults'}")
    return 0


def cmd_check(args) -> int:
    from fastft import checks

    device = _device(args.device)
    max_tokens = args.max_tokens if args.max_tokens is not None else (2048 if device.type == "cuda" else 96)
    g = torch.Generator().manual_seed(args.seed if args.seed is not None else int(time.time_ns() % 2**62))
    print(
        f"check on {_describe(device)}: triton vs torch, up to {max_tokens} tokens, {args.seconds}s, "
        f"seed {g.initial_seed()}"
    )
    runs = failures = 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline or runs == 0:
        for name, check in checks.CHECKS.items():
            runs += 1
            try:
                check(g, device, max_tokens)
            except AssertionError as e:
                failures += 1
                print(f"MISMATCH in {name}: {e}")
    print(f"{runs} cases, {failures} failures")
    return 1 if failures else 0


def _bench_modules(names):
    from fastft.bench import (
        attention,
        conv,
        copy,
        delta_rule,
        experts,
        lora,
        offload,
        offloader,
        packing,
        routing,
        swiglu,
    )

    modules = {
        "packing": packing,
        "routing": routing,
        "attention": attention,
        "conv": conv,
        "copy": copy,
        "offloader": offloader,
        "offload": offload,
        "lora": lora,
        "experts": experts,
        "delta_rule": delta_rule,
        "swiglu": swiglu,
    }
    return {name: modules[name] for name in (names or modules)}


def _record(device, rows) -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "device": _describe(device),
        "versions": _versions(),
        "command": " ".join(["python -m fastft"] + sys.argv[1:]),
        "rows": rows,
    }


def _check_e2e_args(args, device) -> None:
    """Usage errors of bench --e2e (and audit) found before anything runs."""
    from fastft.bench import e2e, quant

    if why := quant.why_unavailable(args.quant, device):
        args.usage_error(f"--quant {args.quant} {why}")
    for column in args.column or ():
        why = e2e.why_not(column, device)
        if why:
            args.usage_error(f"--column '{column}' cannot run here: it {why}")
    names = args.model if isinstance(args.model, list) else [args.model] if args.model else []
    for column in args.column or ():
        reasons = [e2e.why_not_on(column, n) for n in names]
        if names and all(reasons):
            args.usage_error(f"--column '{column}' {reasons[0]}, not {', '.join(names)}")


def cmd_bench_e2e(args, device) -> int:
    from fastft.bench import e2e

    _check_e2e_args(args, device)
    if args.nproc is not None:
        return cmd_bench_distributed(args, device)
    plan = dict(stream=args.stream, warmup=args.warmup, steps=args.steps, quant=args.quant)
    print(e2e.describe(device, args.quick, args.column, **plan))
    records = e2e.run(device, args.quick, args.model, args.column, **plan)
    if not records:
        print("nothing ran", file=sys.stderr)
        return 2
    print(e2e.format_table(records))
    print(e2e.LEGEND)
    agree = e2e.loss_check(records)
    print(agree[1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_record(device, records), f, indent=1)
        print(f"wrote {args.json}")
        png = os.path.splitext(args.json)[0] + ".png"
        if e2e.chart(records, png):
            print(f"wrote {png}")
    return 0 if agree[0] else 1


def cmd_bench_distributed(args, device) -> int:
    from fastft.bench import distributed

    if device.type not in ("cpu", "cuda"):
        args.usage_error(f"--nproc runs on CUDA GPUs or CPUs, not {device.type}")
    if device.type == "cpu" and torch.cuda.is_available():
        args.usage_error("--nproc with --device cpu on a machine with GPUs: the ranks would take the GPUs")
    if "ep" in (args.parallel or ()):  # checked before spawning: a worker would fail a minute in
        tiny = args.quick or device.type != "cuda"
        for name in args.model or distributed.MODELS:
            experts = _num_experts(name, tiny)
            if experts and experts % args.nproc:
                args.usage_error(
                    f"--parallel ep gives each rank an equal share of {name}'s {experts} experts"
                    f"{' (tiny config)' if tiny else ''}: {experts} experts do not split over --nproc {args.nproc}"
                )
    if device.type == "cuda" and torch.cuda.device_count() < args.nproc:
        args.usage_error(f"--nproc {args.nproc} needs {args.nproc} GPUs, this machine has {torch.cuda.device_count()}")
    records = distributed.run(args.nproc, args.quick, args.model, args.column, args.parallel)
    if not records:
        print("nothing ran: --parallel ep/'hf ep' need a MoE --model (and ep a fastft --column)")
        return 2
    print(distributed.format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_record(device, records), f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _num_experts(name: str, tiny: bool) -> int:
    """Routed experts per layer of the e2e model ``name`` as the benchmark builds it (0: dense)."""
    from fastft.bench import e2e

    try:
        config = e2e.model_config(name, tiny)
    except ImportError:  # no transformers: the run says so
        return 0
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0


def cmd_audit(args) -> int:
    from fastft.audit import audit
    from fastft.bench import e2e
    from fastft.graphs import capture_count
    from fastft.integrations.transformers import decoder_layers

    device = _device(args.device)
    _check_e2e_args(argparse.Namespace(**{**vars(args), "column": [args.column]}), device)
    tiny = args.quick or device.type != "cuda"
    stream = e2e.model_stream(args.model, args.stream, tiny, device)
    # The profiled steps' batches, which the warm-up passes run first: graphed columns capture there.
    batches = itertools.cycle([next(stream) for _ in range(args.steps)])
    (model, _), restore = e2e.build(args.model, args.column, device, tiny, quant=args.quant)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step():  # each call trains on the next batch (padded columns: its micro-batches)
        e2e.train_step(model, opt, e2e.step_inputs(args.column, next(batches), args.model, tiny, args.host_lengths))

    try:
        lengths = ", boundaries as host cu_seq_lens_q" if args.host_lengths else ""
        lengths += ", decoder linear layers in bitsandbytes 4-bit nf4" if args.quant == "nf4" else ""
        print(
            f"{args.model}, column '{args.column}', {args.stream} stream{lengths}" + (" (tiny config)" if tiny else "")
        )
        for _ in range(args.warmup * args.steps):
            step()
        captures = capture_count()
        print(audit(step, model=model, layers=decoder_layers(model), steps=args.steps, warmup=0))
        if capture_count() > captures:  # a capture in the profiled steps: their times are not steady state
            print(f"  CUDA graph captures in the profiled steps: {capture_count() - captures}")
    finally:
        restore()
    return 0


def cmd_bench(args) -> int:
    from fastft.bench import common

    device = _device(args.device)
    quick = args.quick or device.type != "cuda"
    print(
        f"bench on {_describe(device)}"
        + ("  [CPU: small sizes, numbers not representative]" if device.type != "cuda" else "")
    )
    if args.e2e:
        return cmd_bench_e2e(args, device)
    rows = []
    for module in _bench_modules(args.only).values():
        rows += module.run(device, quick)
    print(common.format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_record(device, [dict(r.__dict__, speedup=r.speedup) for r in rows]), f, indent=1)
        print(f"wrote {args.json}")
    return 0


def cmd_tune(args) -> int:
    from fastft.bench import common

    device = _device(args.device)
    if device.type != "cuda":
        print("tune measures launch parameters on a GPU; no CUDA device here", file=sys.stderr)
        return 2
    results: dict = {}
    path = autotune.cache_path(capabilities.arch(device))
    if args.only and path.exists():  # keep the other ops' measured entries
        results = json.loads(path.read_text()).get("ops", {})
    launchers = {}
    for module in _bench_modules(args.only).values():
        launchers.update(getattr(module, "tune_launchers", lambda device: {})(device))
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
        "versions": _versions(),
    }
    print(f"wrote {autotune.write(capabilities.arch(device), results, meta)}")
    return 0


def _prog() -> str:
    """The command as the user typed it: the ``fastft`` console script or ``python -m fastft``."""
    return "fastft" if os.path.basename(sys.argv[0] or "") == "fastft" else "python -m fastft"


BENCH_FAMILIES = (
    "packing",
    "routing",
    "attention",
    "conv",
    "copy",
    "offloader",
    "offload",
    "lora",
    "experts",
    "delta_rule",
    "swiglu",
)


def build_parser() -> argparse.ArgumentParser:
    from fastft.bench.distributed import MODES as DISTRIBUTED_MODES
    from fastft.bench.e2e import COLUMNS, LEGEND, MODELS, STREAM_CHOICES
    from fastft.bench.quant import QUANTS

    intro, _, rest = __doc__.split("\n\n", 2)  # the commands' list is argparse's own
    parser = argparse.ArgumentParser(
        prog=_prog(), description=f"{intro}\n\n{rest}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True, title="commands", metavar="COMMAND")
    p = sub.add_parser("info", help="device, versions, backend and autotune entry per op")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("check", help="differential fuzz: triton vs torch on random inputs")
    p.add_argument("--seconds", type=_positive(float), default=10.0, help="how long to draw cases (default 10)")
    p.add_argument("--seed", type=int, help="generator seed (default: drawn and printed)")
    p.add_argument(
        "--max-tokens", type=_positive(int), help="largest token count drawn (default 2048 on a GPU, 96 on a CPU)"
    )
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser(
        "bench",
        help="baseline vs fastft, median times and ratios; --e2e: fine-tuning steps",
        description="Each op's baseline against fastft (median times, speedup = baseline ms / fastft ms); with "
        "--e2e, fine-tuning steps of transformers models, one column per stack.",
        epilog=LEGEND,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small sizes (always on without a GPU)")
    p.add_argument("--json", help="also write the results to this file (with --e2e, a PNG chart beside it)")
    p.add_argument(
        "--e2e", action="store_true", help="end-to-end fine-tuning steps of transformers models (the main job)"
    )
    p.add_argument(
        "--model",
        action="append",
        choices=list(MODELS),
        metavar="NAME",
        help="with --e2e: only this model (repeatable); one of " + ", ".join(MODELS),
    )
    p.add_argument(
        "--column",
        action="append",
        choices=list(COLUMNS),
        metavar="NAME",
        help="with --e2e: only this column (repeatable); one of " + ", ".join(f"'{c}'" for c in COLUMNS),
    )
    p.add_argument(
        "--stream",
        choices=list(STREAM_CHOICES),
        help="with --e2e: how the stream of fresh batches packs its rows: fixed (exactly the token budget), "
        "padding-free (whole documents: the token count changes every step; the default) or both",
    )
    p.add_argument(
        "--warmup",
        type=_positive(int),
        metavar="W",
        help="with --e2e: first steps per column, timed apart (default 3; 1 with tiny configs)",
    )
    p.add_argument(
        "--steps",
        type=_positive(int),
        metavar="N",
        help="with --e2e: timed steps per column after the first ones (default 20; 2 with tiny configs)",
    )
    p.add_argument(
        "--nproc",
        type=_positive(int),
        metavar="N",
        help="with --e2e: one process per GPU (NCCL; gloo on CPUs), 1 and N processes side by side",
    )
    p.add_argument(
        "--parallel",
        action="append",
        choices=list(DISTRIBUTED_MODES),
        metavar="MODE",
        help="with --nproc (repeatable): ddp (default), fsdp2, ep (fastft's expert parallelism), "
        "'hf ep' (transformers' own)",
    )
    p.set_defaults(fn=cmd_bench, usage_error=p.error)
    p = sub.add_parser(
        "audit", help="profile e2e training steps: launches, host syncs, GPU-busy fraction, why the GPU idled"
    )
    p.add_argument(
        "--model", choices=list(MODELS), default="Qwen3-0.6B", metavar="NAME", help="one of " + ", ".join(MODELS)
    )
    p.add_argument(
        "--column",
        choices=list(COLUMNS),
        default="fastft",
        metavar="NAME",
        help="the stack to build (an e2e column, default 'fastft'); one of " + ", ".join(f"'{c}'" for c in COLUMNS),
    )
    p.add_argument("--steps", type=_positive(int), default=3, help="profiled steps (default 3)")
    p.add_argument(
        "--warmup",
        type=_positive(int),
        default=1,
        help="unprofiled passes over the profiled steps' batches first (default 1): a graphed column captures "
        "each signature there",
    )
    p.add_argument(
        "--stream",
        choices=list(STREAM_CHOICES[:-1]),
        default="padding-free",
        help="the e2e stream each step draws its batch from: fixed or padding-free (default)",
    )
    p.add_argument(
        "--host-lengths",
        action="store_true",
        help="packed columns also get the documents' boundaries from the host (a flattening collator's "
        "cu_seq_lens_q/k and max_length_q/k, cu_seq_lens kept on the CPU), not only device position_ids",
    )
    p.add_argument("--quick", action="store_true", help="tiny config (always on without a GPU)")
    p.set_defaults(fn=cmd_audit, usage_error=p.error)
    p = sub.add_parser("tune", help="measure launch parameters and rewrite autotune_cache/<arch>.json")
    p.set_defaults(fn=cmd_tune)
    for name in ("bench", "audit"):
        sub.choices[name].add_argument(
            "--quant",
            choices=list(QUANTS),
            help=("with --e2e: " if name == "bench" else "")
            + "nf4: the model with its decoder's linear layers in bitsandbytes 4-bit NF4 (QLoRA; "
            "needs a GPU, bitsandbytes, accelerate and peft); default none",
        )
    for name in ("bench", "tune"):
        sub.choices[name].add_argument(
            "--only",
            action="append",
            choices=list(BENCH_FAMILIES),
            help="only these op families (repeatable)",
        )
    for p in sub.choices.values():
        p.add_argument("--device", type=_device_arg, help="torch device (default: cuda if available, else cpu)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "bench" and not args.e2e and args.model:
        args.usage_error("--model is taken with --e2e only")
    if args.cmd == "bench" and not args.e2e and args.column:
        args.usage_error("--column is taken with --e2e only")
    if args.cmd == "bench" and args.nproc is None and args.parallel:
        args.usage_error("--parallel is taken with --nproc only")
    if args.cmd == "bench" and not args.e2e and args.nproc is not None:
        args.usage_error("--nproc is taken with --e2e only")
    for option in ("stream", "warmup", "steps", "quant"):
        if args.cmd == "bench" and getattr(args, option) is not None and (not args.e2e or args.nproc is not None):
            args.usage_error(f"--{option} is taken with --e2e only (not with --nproc)")
    if args.cmd == "bench" and args.e2e and args.only:
        args.usage_error("--only selects op benchmarks; it is not taken with --e2e")
    if args.cmd == "bench" and args.json:  # checked now: a failed write would lose the whole run's results
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            args.usage_error(f"--json {args.json}: the folder {folder} does not exist")
        if os.path.isdir(args.json) or not os.access(folder, os.W_OK):
            args.usage_error(f"--json {args.json}: not a file this user can write")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
