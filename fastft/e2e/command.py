"""The main job's commands: ``python -m fastft e2e`` (fine-tuning steps per stack, the table and the loss
check's verdict; ``--nproc N``: the multi-process steps) and ``python -m fastft audit`` (where one stack's
training step spends its time). ``add_parsers`` adds both to the CLI's subcommands."""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

from fastft import cli

from . import distributed, quant, report, run
from .models import MODEL_CONFIGS as MODELS
from .models import layers_arg, parse_layers
from .stacks import COLUMNS, build, column_inputs, why_not, why_not_on
from .stream import KINDS, STREAM_CHOICES, model_stream
from .train import train_step

BACKENDS = ("auto", "torch", "triton")


def backend_of(choice: str | None, device: torch.device) -> dict:
    """The environment of ``--backend``: ``auto`` (a GPU's default: Triton kernels where fastft has them),
    ``torch`` (a CPU's default, unless ``FASTFT_BACKEND`` says otherwise) or ``triton`` (on a CPU, Triton's
    interpreter: slow by design)."""
    choice = choice or os.environ.get("FASTFT_BACKEND") or ("auto" if device.type == "cuda" else "torch")
    interpret = "1" if choice != "torch" and device.type != "cuda" else None
    return {"FASTFT_BACKEND": choice, "TRITON_INTERPRET": interpret}


def _check_stack(p: argparse.ArgumentParser, args, device: torch.device, names: list[str]) -> None:
    """Usage errors of the stack options (``--quant``, ``--column``, ``--backend``) found before anything runs."""
    from fastft import capabilities

    if args.backend == "triton" and not capabilities.TRITON_AVAILABLE:
        p.error("--backend triton: triton is not installed")
    if why := quant.why_unavailable(args.quant, device):
        p.error(f"--quant {args.quant} {why}")
    for column in args.column or ():
        if why := why_not(column, device):
            p.error(f"--column '{column}' cannot run here: it {why}")
        reasons = [why_not_on(column, n) for n in names]
        if names and all(reasons):
            p.error(f"--column '{column}' {reasons[0]}, not {', '.join(names)}")


def cmd_e2e(args) -> int:
    p, device = args.parser, cli.device_of(args.device)
    if args.parallel and args.nproc is None:
        p.error("--parallel is taken with --nproc only")
    for option in ("stream", "quant", "layers"):
        if args.nproc is not None and getattr(args, option) is not None:
            p.error(f"--{option} is not taken with --nproc (the ranks share the padding-free stream)")
    if args.nproc is not None:
        names = args.model or list(MODELS if args.all else distributed.MODELS)
    else:
        names = run.models_of(device, args.model, args.all)
    _check_stack(p, args, device, names)
    if args.layers is not None:
        if run.tiny_configs(device, args.quick):
            p.error("--layers is taken at real size only (a GPU without --quick): the tiny configs keep 2 layers")
        for name in names:
            try:
                layers_arg(name, args.layers)
            except ValueError as e:
                p.error(f"--layers: {e}")
    with cli.environment(**backend_of(args.backend, device)):
        if args.nproc is not None:
            return _distributed(args, device, names)
        plan = dict(stream=args.stream, warmup=args.warmup, steps=args.steps, quant=args.quant, layers=args.layers)
        print(run.describe(device, args.quick, args.column, models=names, **plan), flush=True)
        records = run.run(device, args.quick, names, args.column, **plan)
    if not records:
        print("nothing ran", file=sys.stderr)
        return 2
    ratios = run.speed_ratios(device, args.quick)
    print(report.format_table(records, ratios))
    if ratios:
        print(report.legend())
    else:
        print(f"(what each column of the table holds: {cli.prog()} e2e --help)")
    if args.json:
        cli.write_json(args.json, device, records)
        png = os.path.splitext(args.json)[0] + ".png"
        why = report.chart(records, png)
        print(f"wrote {png}" if why is None else f"no chart {png}: {why}")
    ok, text = report.loss_check(records)
    print(text)
    return 0 if ok else 1


def _distributed(args, device: torch.device, names: list[str]) -> int:
    p = args.parser
    if device.type == "cpu" and torch.cuda.is_available():
        p.error("--nproc with --device cpu on a machine with GPUs: the ranks would take the GPUs")
    if why := distributed.why_not(args.nproc, names, args.column, args.parallel, args.quick):
        p.error(why)
    records = distributed.run(args.nproc, args.quick, names, args.column, args.parallel, args.warmup, args.steps)
    if not records:
        print("nothing ran: no --column of fastft's or the stock ones runs with these --parallel modes")
        return 2
    print(distributed.format_table(records))
    if args.json:
        cli.write_json(args.json, device, records)
    return 0


def cmd_audit(args) -> int:
    from fastft.audit import audit
    from fastft.graphs import capture_count
    from fastft.integrations.transformers import decoder_layers

    p, device = args.parser, cli.device_of(args.device)
    _check_stack(p, argparse.Namespace(**{**vars(args), "column": [args.column]}), device, [args.model])
    if COLUMNS[args.column].own_process:
        p.error(f"--column '{args.column}' runs in a process of its own: audit profiles a column in this one")
    tiny = run.tiny_configs(device, args.quick)
    layers = None
    if args.layers is not None:
        if tiny:
            p.error("--layers is taken at real size only (a GPU without --quick): the tiny configs keep 2 layers")
        try:
            layers = layers_arg(args.model, args.layers)
        except ValueError as e:
            p.error(f"--layers: {e}")
    with cli.environment(**backend_of(args.backend, device)):
        stream = model_stream(args.model, args.stream, tiny, device)
        # The profiled steps' batches, which the warm-up passes run first: graphed columns capture there.
        batches = itertools.cycle([next(stream) for _ in range(args.steps)])
        (model, _), restore = build(args.model, args.column, device, tiny, quant=args.quant, layers=layers)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5)

        def step():  # each call trains on the next batch (padded columns: its micro-batches)
            inputs = column_inputs(args.column, next(batches), args.model, tiny, args.host_lengths)
            train_step(model, opt, inputs)

        try:
            lengths = ", boundaries as host cu_seq_lens_q" if args.host_lengths else ""
            lengths += ", decoder linear layers in bitsandbytes 4-bit nf4" if args.quant == "nf4" else ""
            tiny_note = " (tiny config)" if tiny else ""
            print(f"{args.model}, column '{args.column}', {args.stream} stream{lengths}{tiny_note}")
            print(f"on {cli.describe(device)}")
            for _ in range(args.warmup * args.steps):
                step()
            captures = capture_count()
            print(audit(step, model=model, layers=decoder_layers(model), steps=args.steps, warmup=0))
            if capture_count() > captures:  # a capture in the profiled steps: their times are not steady state
                print(f"  CUDA graph captures in the profiled steps: {capture_count() - captures}")
        finally:
            restore()
    return 0


def _stack_options(p: argparse.ArgumentParser) -> None:
    """The options of ``e2e`` and ``audit`` that build a stack."""
    p.add_argument(
        "--quant",
        choices=list(quant.QUANTS),
        help="nf4: the model with its decoder's linear layers in bitsandbytes 4-bit NF4 (QLoRA; needs a GPU, "
        "bitsandbytes, accelerate and peft); default none",
    )
    p.add_argument(
        "--backend",
        choices=list(BACKENDS),
        help="what fastft's ops run: auto (Triton kernels where fastft has them; a GPU's default), torch (its torch "
        "paths; a CPU's default) or triton (on a CPU: Triton's interpreter, minutes per column); default: "
        "FASTFT_BACKEND where set",
    )
    p.add_argument("--quick", action="store_true", help="tiny configs (always on without a GPU)")


E2E_HELP = """Fine-tuning steps of transformers models (random weights), one column per stack: naive glue, stock
transformers, Liger-Kernel, Unsloth, and fastft's stacks, the same weights and stream of fresh packed rows for
each. It ends with one line, 'loss check: PASS' or 'loss check: FAIL' (exit status 1): every fastft column's
loss equals the reference column's at every step.

On a CPU: tiny configs of a dense, a MoE and a hybrid model (--all: every model), fastft's torch paths
(--backend triton: its Triton kernels in Triton's interpreter), no speed ratios. On a GPU: every model at real
size, and the table's speed ratios."""


def add_parsers(sub) -> None:
    """``e2e`` and ``audit`` added to the CLI's subparsers ``sub``."""
    models = ", ".join(MODELS)
    columns = ", ".join(f"'{c}'" for c in COLUMNS)
    p = sub.add_parser(
        "e2e",
        help="the main job: fine-tuning steps per stack, and a loss check of fastft against the reference",
        description=E2E_HELP,
        epilog=report.legend(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        action="append",
        choices=list(MODELS),
        metavar="NAME",
        help=f"only this model (repeatable); one of {models}",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help=f"every model (a GPU's default; a CPU runs {', '.join(run.REPRESENTATIVE)})",
    )
    p.add_argument(
        "--column",
        action="append",
        choices=list(COLUMNS),
        metavar="NAME",
        help=f"only this column (repeatable), in the order named; one of {columns}",
    )
    p.add_argument(
        "--stream",
        choices=list(STREAM_CHOICES),
        help="how the stream of fresh batches packs its rows: fixed (exactly the token budget), padding-free "
        "(whole documents: the token count changes every step; the default) or both",
    )
    p.add_argument(
        "--warmup",
        type=cli.positive(int),
        metavar="W",
        help="first steps per column, timed apart (default 3; 1 with tiny configs)",
    )
    p.add_argument(
        "--steps",
        type=cli.positive(int),
        metavar="N",
        help="timed steps per column after the first ones (default 20; 2 with tiny configs)",
    )
    _stack_options(p)
    p.add_argument(
        "--layers",
        type=parse_layers,
        metavar="N",
        help="decoder layers each model keeps at real size: a number, or 'all' (the released model's depth); "
        "default the model table's (fewer for the large ones)",
    )
    p.add_argument(
        "--nproc",
        type=cli.positive(int),
        metavar="N",
        help="one process per GPU (NCCL; gloo on CPUs) on a fresh share of the stream every step (rows, and "
        "balanced), against the same documents on one GPU (default models: "
        f"{', '.join(distributed.MODELS)})",
    )
    p.add_argument(
        "--parallel",
        action="append",
        choices=list(distributed.MODES),
        metavar="MODE",
        help="with --nproc (repeatable): ddp (default), fsdp2, shard (fastft.integrations.fsdp.shard), ep "
        "(fastft's expert parallelism, MoE models), "
        "'hf ep' (transformers' own, MoE models)",
    )
    p.add_argument("--json", type=cli.json_path, help="also write the records to this file, and a PNG chart beside it")
    p.set_defaults(fn=cmd_e2e, parser=p)

    p = sub.add_parser(
        "audit",
        help="profile e2e training steps: launches, host syncs, GPU-busy fraction, why the GPU idled",
        description="Where one stack's training steps spend their time (fastft.audit): kernel launches, host "
        "syncs and the op each came from, the GPU-busy fraction, why the GPU idled, per decoder layer.",
    )
    p.add_argument("--model", choices=list(MODELS), default="Qwen3-0.6B", metavar="NAME", help=f"one of {models}")
    p.add_argument(
        "--column",
        choices=list(COLUMNS),
        default="fastft",
        metavar="NAME",
        help=f"the stack to build (an e2e column, default 'fastft'); one of {columns}",
    )
    p.add_argument("--steps", type=cli.positive(int), default=3, help="profiled steps (default 3)")
    p.add_argument(
        "--warmup",
        type=cli.positive(int),
        default=1,
        help="unprofiled passes over the profiled steps' batches first (default 1): a graphed column captures "
        "each signature there",
    )
    p.add_argument(
        "--stream",
        choices=list(KINDS),
        default="padding-free",
        help="the e2e stream each step draws its batch from: fixed or padding-free (default)",
    )
    p.add_argument(
        "--host-lengths",
        action="store_true",
        help="packed columns also get the documents' boundaries from the host (a flattening collator's "
        "cu_seq_lens_q/k and max_length_q/k, cu_seq_lens kept on the CPU), not only device position_ids",
    )
    p.add_argument(
        "--layers",
        type=parse_layers,
        metavar="N",
        help="decoder layers the model keeps at real size: a number, or 'all' (the released model's depth); "
        "default the model table's",
    )
    _stack_options(p)
    p.set_defaults(fn=cmd_audit, parser=p)
