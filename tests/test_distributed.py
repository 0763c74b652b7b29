"""fastft under torch.distributed, processes spawned by the test (``fastft.spawn.run``): a model wrapped after
``apply`` (DDP, FSDP2, FSDP2 with bf16 mixed precision and fp32 LoRA adapters, ``fastft.integrations.fsdp.
shard``'s layouts, fastft's expert parallelism under DDP, FSDP2 and ``shard``, transformers' own
expert-parallel plan) gives each rank the loss of one process on that rank's packed row and the gradient of
one process on the global batch (the mean of the ranks' losses); ``shard``'s sharded optimizer step gives one
process's parameters. One case also runs under ``torchrun --nnodes 2`` (two "nodes" on this host).

CI runs them on CPUs (gloo, 2 processes; the ops' torch paths, the offload as plain recompute). On GPUs the
same tests run on NCCL with the Triton paths, CUDA streams and pinned memory, one GPU per rank:
``NCCL_NVLS_ENABLE=0 FASTFT_DIST_BACKEND=nccl FASTFT_DIST_WORLD=N pytest -m distributed`` (N <= the GPUs
present). Every run is bounded: a rank that fails stops the others, and ``FASTFT_DIST_TIMEOUT`` seconds (300)
stop a test that hangs."""

import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("needs torch.distributed", allow_module_level=True)

from fastft import spawn  # noqa: E402
from fastft.offload import offloader_for  # noqa: E402

BACKEND = os.environ.get("FASTFT_DIST_BACKEND", "gloo")
WORLD = int(os.environ.get("FASTFT_DIST_WORLD", "2"))
TIMEOUT = float(os.environ.get("FASTFT_DIST_TIMEOUT", "300"))
LENGTHS = [[5, 9, 6], [7, 3, 10], [4, 4, 12], [20]]  # rank r's packed row: documents of LENGTHS[r % 4]
EXPERTS = 6 if 6 % WORLD == 0 else 2 * WORLD  # the tiny MoE's experts split over the ranks

pytestmark = pytest.mark.distributed
if BACKEND not in ("gloo", "nccl"):
    raise ValueError(f"FASTFT_DIST_BACKEND must be gloo or nccl, got {BACKEND!r}")
if BACKEND == "gloo" and not dist.is_gloo_available():
    pytest.skip("needs gloo", allow_module_level=True)
# (a torchrun worker of test_two_nodes_under_torchrun runs this file as __main__, seeing its node's GPU alone)
if __name__ != "__main__" and BACKEND == "nccl" and (not dist.is_nccl_available() or torch.cuda.device_count() < WORLD):
    pytest.skip(f"needs NCCL and {WORLD} GPUs ({torch.cuda.device_count()} here)", allow_module_level=True)
if WORLD < 1:
    raise ValueError(f"FASTFT_DIST_WORLD must be >= 1, got {WORLD}")


def device():
    """This process's device: its GPU under NCCL (set by ``fastft.spawn`` or torchrun's LOCAL_RANK)."""
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def build(family, lora, dtype=torch.float32, path=None, **from_pretrained):
    import fastft.integrations.transformers as ft_hf
    from fastft.testing import tiny_hf_model

    fields = {"num_experts": EXPERTS} if family == "qwen3_moe" else {}
    if path is None:
        model = tiny_hf_model(family, dtype=dtype, device=device(), **fields)
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **from_pretrained)
        model = model.to(device()).train()  # one rank's plan may leave it where it was loaded
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    return ft_hf.apply(model)


def batch(rank, wrap):
    row = 0 if wrap == "hf ep" else rank  # transformers' plan: every rank runs the same tokens
    lengths = LENGTHS[row % len(LENGTHS)]
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(10 + row))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {k: v.to(device()) for k, v in dict(input_ids=ids, labels=ids, position_ids=positions).items()}


DTYPE = {"fsdp2 bf16": torch.bfloat16}


def fastft_ep(wrap) -> bool:
    """Whether the case runs fastft's expert parallelism (``use_expert_parallel``)."""
    return "ep" in wrap.split() and wrap != "hf ep"


LR = 0.5  # the SGD step after the shard cases' last backward


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()


def worker(rank, out, family, wrap, lora, path):
    import fastft.integrations.transformers as ft_hf

    world = dist.get_world_size()
    dtype = DTYPE.get(wrap, torch.float32)
    sharded = set()  # names of parameters each rank holds a slice of (fastft's expert parallelism)
    if wrap == "hf ep":
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(tp_plan="auto", enable_expert_parallel=True)
        model = build(family, lora, path=path, distributed_config=config)
        assert ft_hf.hf_model(model).config._experts_implementation == ft_hf.EXPERTS_IMPLEMENTATION
        wrapped = model
    else:
        model = build(family, lora, dtype)
        ignored = set()
        if fastft_ep(wrap):  # its own group keeps the all-to-alls apart from DDP's all-reduces
            ft_hf.use_expert_parallel(model, dist.new_group(list(range(world))))
            ignored = ft_hf.expert_parameters(model)
            sharded = {n for n, p in model.named_parameters() if any(p is q for q in ignored)}
        if wrap.startswith("ddp") or wrap == "ep":
            from torch.nn.parallel import DistributedDataParallel

            options = {"ddp unused": {"find_unused_parameters": True}, "ddp static": {"static_graph": True}}
            # EP with LoRA: DDP around the transformers model inside the PEFT wrapper (use_expert_parallel
            # got the wrapper; the experts must stay out of DDP's broadcast either way)
            target = ft_hf.hf_model(model) if wrap == "ep" and lora else model
            wrapped = DistributedDataParallel(target, **options.get(wrap, {}))
        elif wrap.startswith("shard"):
            from fastft.integrations.fsdp import shard

            layout = "full" if "full" in wrap else "auto"
            wrapped = shard(model, layout=layout, prefetch=2 if "prefetch" in wrap else 1)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            from fastft.integrations.transformers import decoder_layers

            for n, p in model.named_parameters():  # PEFT keeps adapters fp32 beside bf16 base weights
                assert p.dtype == (torch.float32 if "lora_" in n else dtype), (n, p.dtype)
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            if wrap == "fsdp2 adapters":  # each adapter its own FSDP unit, unsharded by its own forward only
                for name, module in model.named_modules():
                    if name.endswith(("lora_A.default", "lora_B.default")):
                        fully_shard(module, mp_policy=policy)
            for layer in decoder_layers(model):
                fully_shard(layer, mp_policy=policy, ignored_params=ignored)
            wrapped = fully_shard(model, mp_policy=policy, ignored_params=ignored)
    import fastft.integrations.peft as ft_peft

    fastft_lora = []  # calls of fastft's LoRA path
    ft_peft.lora_linear = lambda *a, _f=ft_peft.lora_linear: fastft_lora.append(1) or _f(*a)
    pinned = []  # on GPUs: the offload's pinned host bytes after each step
    for _ in range(3):  # later steps check nothing grew stale between steps (hooks, buffers, pinned pool)
        model.zero_grad(set_to_none=True)
        loss = wrapped(**batch(rank, wrap)).loss
        loss.backward()
        if BACKEND == "nccl":
            pinned.append(offloader_for(torch.empty(1, device=device())).pool.held_bytes)
    if pinned:  # (GPU memory across 100 offloaded steps: tests/test_offload_gpu.py)
        assert pinned[1] > 0 and pinned[1] == pinned[2], f"nothing offloaded, or the pinned pool grew: {pinned}"
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    # fastft's LoRA path runs wherever the adapters are plain tensors in forward; an adapter that is its
    # own FSDP2 unit is still sharded there, so PEFT's forward (which unshards it) runs instead
    assert bool(fastft_lora) == (lora and wrap != "fsdp2 adapters"), (wrap, len(fastft_lora))
    stepped = None
    if wrap.startswith("shard"):  # the optimizer steps on each rank's shards: one process's parameters
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR).step()
        stepped = {n: full(p) for n, p in model.named_parameters() if p.requires_grad and n not in sharded}
    gathered = None
    if fastft_ep(wrap):  # revert gathers every rank's experts back: the full weights every rank loaded
        ft_hf.revert(model)
        loaded = dict(build(family, lora, dtype).named_parameters())
        params = dict(model.named_parameters())
        gathered = all(torch.equal(params[n], loaded[n]) for n in sharded)
    result = {"loss": loss.detach().float().cpu(), "grads": grads, "sharded": sharded, "gathered": gathered}
    torch.save({**result, "stepped": stepped}, f"{out}.{rank}")


CASES = [
    ("llama", "ddp", False),
    ("llama", "ddp static", True),
    ("llama", "fsdp2", False),
    ("llama", "fsdp2 adapters", True),
    ("qwen3", "fsdp2 bf16", True),  # bf16 base weights and compute, fp32 LoRA adapters and reduction
    ("qwen3_moe", "ddp unused", False),
    ("qwen3_moe", "fsdp2", True),
    ("qwen3_moe", "ep", False),  # fastft's expert parallelism under DDP
    ("qwen3_moe", "ep fsdp2", False),  # ... under FSDP2, the experts left to EP (ignored_params)
    ("qwen3_moe", "ep", True),  # ... with LoRA on attention (frozen experts), DDP around the inner model
    ("qwen3_moe", "hf ep", False),  # transformers' expert-parallel plan with fastft's experts path
    ("llama", "shard", True),  # shard(): the frozen base whole on every rank, the adapters sharded
    ("llama", "shard prefetch", False),  # full fine-tuning ("auto" is "full"), two layers prefetched
    ("qwen3_moe", "shard full ep", True),  # LoRA, every parameter sharded but the experts (left to EP)
]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-3, rtol=2e-2)}


def check(results, family, wrap, lora, world):
    """Each rank's results against one process on the global batch (see the module docstring)."""
    dtype = DTYPE.get(wrap, torch.float32)
    model = build(family, lora, dtype=dtype)
    ranks = 1 if wrap == "hf ep" else world
    losses = []
    for rank in range(ranks):  # one process: the global batch's loss is the mean of the ranks' losses
        loss = model(**batch(rank, wrap)).loss
        (loss / ranks).backward()
        losses.append(loss.detach().float().cpu())
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    assert grads, "nothing was trained"
    sharded = results[0]["sharded"]
    assert bool(sharded) == fastft_ep(wrap)  # (an unsliced expert gradient would mismatch in shape below)
    for name in sharded & grads.keys():  # each rank's slice of the experts, in rank order
        whole = torch.cat([r["grads"][name] for r in results])
        for r in results:
            r["grads"][name] = whole
    for rank, result in enumerate(results):
        assert result["gathered"] is (True if fastft_ep(wrap) else None)
        torch.testing.assert_close(result["loss"], losses[rank % ranks], **TOLERANCE[dtype])
        assert result["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, **TOLERANCE[dtype], msg=f"rank {rank}: {name}")
    if wrap.startswith("shard"):
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR).step()
        want = {n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
        for rank, result in enumerate(results):
            assert result["stepped"].keys() == want.keys() - sharded and result["stepped"]
            for name, value in result["stepped"].items():
                torch.testing.assert_close(value, want[name], **TOLERANCE[dtype], msg=f"rank {rank}: {name} stepped")


@pytest.mark.parametrize("family, wrap, lora", CASES)
def test_matches_one_process(family, wrap, lora, tmp_path, monkeypatch):
    if BACKEND == "gloo":
        monkeypatch.setenv("FASTFT_BACKEND", "torch")  # the ops' CPU path (the interpreter is not what is tested)
    else:
        monkeypatch.setenv("FASTFT_OFFLOAD_MIN_BYTES", "0")  # the tiny layers' inputs are offloaded too
    path = None
    if wrap == "hf ep":
        from fastft.testing import tiny_hf_model

        path = str(tmp_path / "model")
        tiny_hf_model(family, num_experts=EXPERTS).save_pretrained(path)
    out = str(tmp_path / "out")
    spawn.run(worker, (out, family, wrap, lora, path), world=WORLD, backend=BACKEND, timeout=TIMEOUT)
    check([torch.load(f"{out}.{r}") for r in range(WORLD)], family, wrap, lora, WORLD)


def unignored_worker(rank):
    """FSDP2 over a model under fastft's expert parallelism, the experts not left out: refused, not wrong."""
    from torch.distributed.fsdp import fully_shard

    import fastft.integrations.transformers as ft_hf
    from fastft.integrations.transformers import decoder_layers

    model = ft_hf.use_expert_parallel(build("qwen3_moe", False))
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    with pytest.raises(ValueError, match="ignored_params=expert_parameters"):
        model(**batch(rank, "fsdp2"))


def test_fsdp2_must_leave_the_experts_to_expert_parallelism(monkeypatch):
    if BACKEND == "gloo":
        monkeypatch.setenv("FASTFT_BACKEND", "torch")
    spawn.run(unignored_worker, world=WORLD, backend=BACKEND, timeout=TIMEOUT)


def one_rank_worker(rank, out):
    """fastft's expert parallelism over a group of one rank runs the plain experts path (no all-to-all, no host
    sync): the loss and gradients of the model without it."""
    import fastft.integrations.transformers as ft_hf
    from fastft.integrations.transformers import experts

    def refuse(*args, **kwargs):
        raise AssertionError("moe_expert_parallel ran over a group of one rank")

    experts.moe_expert_parallel = refuse
    results = []
    for ep in (False, True):
        model = build("qwen3_moe", False)
        if ep:
            ft_hf.use_expert_parallel(model, dist.new_group([rank]))
        model(**batch(rank, "ep")).loss.backward()
        results.append({n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None})
    torch.save(results, f"{out}.{rank}")


def test_expert_parallel_over_one_rank_is_the_plain_model(tmp_path, monkeypatch):
    if BACKEND == "gloo":
        monkeypatch.setenv("FASTFT_BACKEND", "torch")
    out = str(tmp_path / "out")
    spawn.run(one_rank_worker, (out,), world=1, backend=BACKEND, timeout=TIMEOUT)
    plain, ep = torch.load(f"{out}.0")
    assert plain.keys() == ep.keys() and any("experts" in n for n in ep)
    for n in plain:
        assert torch.equal(plain[n], ep[n]), n


def generate_worker(rank, out):
    """A model under fastft's expert parallelism generates (greedy, with its cache, in eval and train mode) the
    tokens of the model before ``apply``, which holds every expert."""
    import copy

    import fastft.integrations.transformers as ft_hf
    from fastft.testing import tiny_hf_model

    reference = tiny_hf_model("qwen3_moe", num_experts=EXPERTS, device=device())
    model = ft_hf.use_expert_parallel(ft_hf.apply(copy.deepcopy(reference)))
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(rank)).to(device())
    results = {}
    for mode in (False, True):
        for m in (reference, model):
            m.train(mode)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
        results[mode] = (model.generate(input_ids=ids, **kw).cpu(), reference.generate(input_ids=ids, **kw).cpu())
    torch.save(results, f"{out}.{rank}")


def test_expert_parallel_model_generates(tmp_path, monkeypatch):
    if BACKEND == "gloo":
        monkeypatch.setenv("FASTFT_BACKEND", "torch")
    out = str(tmp_path / "out")
    spawn.run(generate_worker, (out,), world=WORLD, backend=BACKEND, timeout=TIMEOUT)
    for rank in range(WORLD):
        for mode, (got, want) in torch.load(f"{out}.{rank}").items():
            assert torch.equal(got, want), f"rank {rank}, train mode {mode}: {got} != {want}"


def test_shard_errors(tmp_path):
    from fastft.integrations.fsdp import shard

    if dist.is_initialized():
        pytest.skip("a process group is set up in this process")
    model = build("llama", True)
    with pytest.raises(ValueError, match="init_process_group"):
        shard(model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:  # each is refused before FSDP2 touches the model
        with pytest.raises(ValueError, match="layout must be one of"):
            shard(model, layout="replicate")
        with pytest.raises(TypeError, match="reshard_after_forward must be True, False or None"):
            shard(model, reshard_after_forward=1)
        with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
            shard(model, prefetch=-1)
        with pytest.raises(TypeError, match="ignored_params must hold torch.nn.Parameter"):
            shard(model, ignored_params=[torch.zeros(1)])
        with pytest.raises(TypeError, match="ignored_params must be a collection of parameters, got int"):
            shard(model, ignored_params=3)
        with pytest.raises(ValueError, match="nothing to shard"):
            shard(model, layout="full", ignored_params=set(model.parameters()))
        with pytest.raises(TypeError, match="transformers PreTrainedModel"):
            shard(torch.nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()


# ---- torchrun --nnodes 2 -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_under_torchrun(tmp_path):
    """Two torchrun launchers on this host, one process each, as two nodes would (c10d rendezvous on
    localhost; under NCCL each "node" sees one GPU): the same results as ``test_matches_one_process``."""
    if BACKEND == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs ({torch.cuda.device_count()} here)")
    family, wrap, lora = "llama", "shard", True
    port, out = _free_port(), str(tmp_path / "out")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launchers = []
    for node in range(2):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        if BACKEND == "gloo":
            env["FASTFT_BACKEND"] = "torch"
        else:  # one GPU per "node"; they reach each other through host memory, as no P2P crosses nodes
            env.update(CUDA_VISIBLE_DEVICES=str(node), NCCL_P2P_DISABLE="1", FASTFT_OFFLOAD_MIN_BYTES="0")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "fastft-test",
            os.path.abspath(__file__),
            out,
            family,
            wrap,
            str(lora),
        ]
        launchers.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        logs = [p.communicate(timeout=TIMEOUT)[0].decode(errors="replace") for p in launchers]
    finally:
        for p in launchers:
            p.kill()
    for p, log in zip(launchers, logs):
        assert p.returncode == 0, log[-4000:]
    check([torch.load(f"{out}.{r}") for r in range(2)], family, wrap, lora, 2)


if __name__ == "__main__":  # one torchrun worker of test_two_nodes_under_torchrun: out, family, wrap, lora
    import datetime

    out, family, wrap, lora = sys.argv[1:5]
    if BACKEND == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(BACKEND, timeout=datetime.timedelta(seconds=spawn.COLLECTIVE_TIMEOUT))
    worker(dist.get_rank(), out, family, wrap, lora == "True", None)
    dist.destroy_process_group()
    spawn.exit_spawned_worker()
