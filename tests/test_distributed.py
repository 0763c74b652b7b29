"""fastft under torch.distributed on CPUs (gloo, 2 processes spawned by the test): a model wrapped in DDP or
FSDP2 (``fully_shard`` on each decoder layer and the root) after ``apply`` gives, on each rank's own packed
row, the loss of one process on that row and the gradient of one process on the global batch (the mean of
the ranks' losses). On a CPU the offload is plain recompute and the ops run their CPU paths; the CUDA
variants (NCCL, streams, pinned memory beside FSDP's prefetch) belong to the GPU session."""

import pytest
import torch

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

WORLD = 2
LENGTHS = [[5, 9, 6], [7, 3, 10]]  # each rank's packed row


def build(family, lora):
    import fastft.integrations.transformers as ft_hf
    from fastft.testing import tiny_hf_model

    model = tiny_hf_model(family)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    return ft_hf.apply(model)


def batch(rank):
    lengths = LENGTHS[rank]
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(10 + rank))
    return dict(input_ids=ids, labels=ids, position_ids=torch.cat([torch.arange(n) for n in lengths])[None])


def worker(rank, init, out, family, wrap, lora):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        model = build(family, lora)
        if wrap.startswith("ddp"):
            from torch.nn.parallel import DistributedDataParallel

            options = {"ddp": {}, "ddp unused": {"find_unused_parameters": True}, "ddp static": {"static_graph": True}}
            wrapped = DistributedDataParallel(model, **options[wrap])
        else:
            from torch.distributed.fsdp import fully_shard

            from fastft.audit import decoder_layers

            for layer in decoder_layers(model):
                fully_shard(layer)
            wrapped = fully_shard(model)
        for _ in range(2):  # the second step checks nothing grew stale between steps (hooks, buffers)
            model.zero_grad(set_to_none=True)
            loss = wrapped(**batch(rank)).loss
            loss.backward()
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        torch.save({"loss": loss.detach(), "grads": grads}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "family, wrap, lora",
    [
        ("llama", "ddp", False),
        ("llama", "ddp static", True),
        ("llama", "fsdp2", False),
        ("qwen3_moe", "ddp unused", False),
        ("qwen3_moe", "fsdp2", True),
    ],
)
def test_matches_one_process(family, wrap, lora, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFT_BACKEND", "torch")  # the ops' CPU path (the interpreter is not what is tested)
    out = str(tmp_path / "out")
    mp.spawn(worker, args=(str(tmp_path / "init"), out, family, wrap, lora), nprocs=WORLD)
    results = [torch.load(f"{out}.{r}") for r in range(WORLD)]

    model = build(family, lora)
    losses = []
    for rank in range(WORLD):  # one process: the global batch's loss is the mean of the ranks' losses
        loss = model(**batch(rank)).loss
        (loss / WORLD).backward()
        losses.append(loss.detach())
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["loss"], losses[rank], atol=1e-5, rtol=1e-5)
        assert result["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=f"rank {rank}: {name}")
