"""fastft under torch.distributed, processes spawned by the test: a model wrapped after ``apply`` (DDP, FSDP2,
FSDP2 with bf16 mixed precision and fp32 LoRA adapters, fastft's expert parallelism under DDP and under
FSDP2, transformers' own expert-parallel plan) gives each rank the loss of one process on that rank's
packed row and the gradient of one process on the global batch (the mean of the ranks' losses).

CI runs them on CPUs (gloo, 2 processes; the ops' torch paths, the offload as plain recompute). On GPUs the
same tests run on NCCL with the Triton paths, CUDA streams and pinned memory:
``FASTFT_DIST_BACKEND=nccl FASTFT_DIST_WORLD=1 pytest -m distributed`` (WORLD <= the GPUs present)."""

import os

import pytest
import torch

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("needs torch.distributed", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

from fastft.offload import offloader_for  # noqa: E402
from fastft.spawn import exit_spawned_worker  # noqa: E402

BACKEND = os.environ.get("FASTFT_DIST_BACKEND", "gloo")
WORLD = int(os.environ.get("FASTFT_DIST_WORLD", "2"))
LENGTHS = [[5, 9, 6], [7, 3, 10], [4, 4, 12], [20]]  # rank r's packed row: documents of these lengths

pytestmark = pytest.mark.distributed
if BACKEND == "gloo" and not dist.is_gloo_available():
    pytest.skip("needs gloo", allow_module_level=True)
if BACKEND == "nccl" and (not dist.is_nccl_available() or torch.cuda.device_count() < WORLD):
    pytest.skip(f"needs NCCL and {WORLD} GPUs", allow_module_level=True)
if not 1 <= WORLD <= len(LENGTHS):
    raise ValueError(f"FASTFT_DIST_WORLD must be in [1, {len(LENGTHS)}], got {WORLD}")


def device(rank):
    return torch.device(f"cuda:{rank}") if BACKEND == "nccl" else torch.device("cpu")


def build(family, lora, rank=0, dtype=torch.float32, path=None, **from_pretrained):
    import fastft.integrations.transformers as ft_hf
    from fastft.testing import tiny_hf_model

    if path is None:
        model = tiny_hf_model(family, dtype=dtype, device=device(rank))
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **from_pretrained)
        model = model.to(device(rank)).train()  # one rank's plan may leave it where it was loaded
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
    lengths = LENGTHS[row]
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(10 + row))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {k: v.to(device(rank)) for k, v in dict(input_ids=ids, labels=ids, position_ids=positions).items()}


DTYPE = {"fsdp2 bf16": torch.bfloat16}


def worker(rank, init, out, family, wrap, lora, path):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        import fastft.integrations.transformers as ft_hf

        dtype = DTYPE.get(wrap, torch.float32)
        sharded = set()  # names of parameters each rank holds a slice of (fastft's expert parallelism)
        if wrap == "hf ep":
            from transformers.distributed import DistributedConfig

            config = DistributedConfig(tp_plan="auto", enable_expert_parallel=True)
            model = build(family, lora, rank, path=path, distributed_config=config)
            assert ft_hf.hf_model(model).config._experts_implementation == ft_hf.EXPERTS_IMPLEMENTATION
            wrapped = model
        else:
            model = build(family, lora, rank, dtype)
            ignored = set()
            if wrap.startswith("ep"):  # its own group keeps the all-to-alls apart from DDP's all-reduces
                ft_hf.use_expert_parallel(model, dist.new_group(list(range(WORLD))))
                ignored = ft_hf.expert_parameters(model)
                sharded = {n for n, p in model.named_parameters() if any(p is q for q in ignored)}
            if wrap.startswith("ddp") or wrap == "ep":
                from torch.nn.parallel import DistributedDataParallel

                options = {"ddp unused": {"find_unused_parameters": True}, "ddp static": {"static_graph": True}}
                # EP with LoRA: DDP around the transformers model inside the PEFT wrapper (use_expert_parallel
                # got the wrapper; the experts must stay out of DDP's broadcast either way)
                target = ft_hf.hf_model(model) if wrap == "ep" and lora else model
                wrapped = DistributedDataParallel(target, **options.get(wrap, {}))
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
                pinned.append(offloader_for(torch.empty(1, device=device(rank))).pool.held_bytes)
        if pinned:  # (GPU memory across 100 offloaded steps: tests/test_offload_gpu.py)
            assert pinned[1] > 0 and pinned[1] == pinned[2], f"nothing offloaded, or the pinned pool grew: {pinned}"
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().float().cpu()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        # fastft's LoRA path runs wherever the adapters are plain tensors in forward; an adapter that is its
        # own FSDP2 unit is still sharded there, so PEFT's forward (which unshards it) runs instead
        assert bool(fastft_lora) == (lora and wrap != "fsdp2 adapters"), (wrap, len(fastft_lora))
        gathered = None
        if wrap.startswith("ep"):  # revert gathers every rank's experts back: the full weights every rank loaded
            ft_hf.revert(model)
            loaded = dict(build(family, lora, rank, dtype).named_parameters())
            params = dict(model.named_parameters())
            gathered = all(torch.equal(params[n], loaded[n]) for n in sharded)
        result = {"loss": loss.detach().float().cpu(), "grads": grads, "sharded": sharded, "gathered": gathered}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    exit_spawned_worker()


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
]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-3, rtol=2e-2)}


@pytest.mark.parametrize("family, wrap, lora", CASES)
def test_matches_one_process(family, wrap, lora, tmp_path, monkeypatch):
    if BACKEND == "gloo":
        monkeypatch.setenv("FASTFT_BACKEND", "torch")  # the ops' CPU path (the interpreter is not what is tested)
    else:
        monkeypatch.setenv("FASTFT_OFFLOAD_MIN_BYTES", "0")  # the tiny layers' inputs are offloaded too
    dtype = DTYPE.get(wrap, torch.float32)
    path = None
    if wrap == "hf ep":
        from fastft.testing import tiny_hf_model

        path = str(tmp_path / "model")
        tiny_hf_model(family).save_pretrained(path)
    out = str(tmp_path / "out")
    mp.spawn(worker, args=(str(tmp_path / "init"), out, family, wrap, lora, path), nprocs=WORLD)
    results = [torch.load(f"{out}.{r}") for r in range(WORLD)]

    model = build(family, lora, dtype=dtype)
    ranks = 1 if wrap == "hf ep" else WORLD
    losses = []
    for rank in range(ranks):  # one process: the global batch's loss is the mean of the ranks' losses
        loss = model(**batch(rank, wrap)).loss
        (loss / ranks).backward()
        losses.append(loss.detach().float().cpu())
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    assert grads, "nothing was trained"
    sharded = results[0]["sharded"]
    assert bool(sharded) == wrap.startswith("ep")  # (an unsliced expert gradient would mismatch in shape below)
    for name in sharded & grads.keys():  # each rank's slice of the experts, in rank order
        full = torch.cat([r["grads"][name] for r in results])
        for r in results:
            r["grads"][name] = full
    for rank, result in enumerate(results):
        assert result["gathered"] is (True if wrap.startswith("ep") else None)
        torch.testing.assert_close(result["loss"], losses[rank % ranks], **TOLERANCE[dtype])
        assert result["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, **TOLERANCE[dtype], msg=f"rank {rank}: {name}")


def unignored_worker(rank, init):
    """FSDP2 over a model under fastft's expert parallelism, the experts not left out: refused, not wrong."""
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.fsdp import fully_shard

        import fastft.integrations.transformers as ft_hf
        from fastft.integrations.transformers import decoder_layers

        model = ft_hf.use_expert_parallel(build("qwen3_moe", False, rank))
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        with pytest.raises(ValueError, match="ignored_params=expert_parameters"):
            model(**batch(rank, "fsdp2"))
    finally:
        dist.destroy_process_group()
    exit_spawned_worker()


def test_fsdp2_must_leave_the_experts_to_expert_parallelism(tmp_path, monkeypatch):
    if BACKEND == "gloo":
        monkeypatch.setenv("FASTFT_BACKEND", "torch")
    mp.spawn(unignored_worker, args=(str(tmp_path / "init"),), nprocs=WORLD)
