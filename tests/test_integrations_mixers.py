"""Token mixers besides attention in packed batches: apply makes Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-Hybrid),
Kimi Delta Attention (Kimi-Linear), Mamba-2 (Bamba, Granite-4.0-H, Falcon-H1, Nemotron-H, Zamba2), Jamba's Mamba,
MiniMax's lightning attention and LFM2's short convolutions packing-correct, and refuses every other transformers
family whose layers mix tokens outside attention, found from the config, the modules and their names."""

import copy
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastft import testing  # noqa: E402
from fastft.integrations.transformers import apply, mixer_ops, mixers, revert, use_packed_attention  # noqa: E402

# transformers 5.17's causal-LM families whose layers mix tokens outside attention (or with attention kinds
# fastft does not implement), each built from its default config on the meta device (no memory)
REFUSED = {
    "recurrent_gemma": "RecurrentGemmaRecurrentBlock",
    "rwkv": "RwkvSelfAttention",
    "xlstm": "xlstm",
    "llama4_text": "chunked_attention",
    "bart": "BartDecoderWrapper",  # positions from the token count, not position_ids
    "deepseek_v32": "deepseek_sparse_attention|indexed_attention",  # its layer type, renamed in 5.24
}
ATTENTION_ONLY = ("llama", "qwen3", "qwen3_moe", "gpt_oss", "gemma3_text", "gemma2", "olmo3", "glm4_moe", "mistral")
# families whose mixers fastft makes packing-correct (their default configs hold such layers)
SUPPORTED = (
    "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "bamba", "granitemoehybrid",
    "falcon_h1", "nemotron_h", "zamba2", "jamba", "minimax", "mamba", "mamba2", "falcon_mamba",
)  # fmt: skip


def meta_model(model_type: str, **fields):
    config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_every_family_with_other_mixers_is_found(model_type):
    model = meta_model(model_type)
    kinds = {b.kind for b in mixers.packing_blockers(model)}
    found = sorted(kind for kind in kinds if re.fullmatch(REFUSED[model_type], kind))
    assert found, kinds
    with pytest.raises(ValueError, match=rf"\b{re.escape(found[0])}\b") as error:  # named, not a prefix of a name
        mixers.check_packing(model)
    assert "packing=False" in str(error.value)


@pytest.mark.parametrize("model_type", ATTENTION_ONLY + SUPPORTED)
def test_attention_only_and_supported_families_pass(model_type):
    assert mixers.packing_blockers(meta_model(model_type)) == []


def test_lfm2_convolutions_are_supported():
    model = meta_model("lfm2", layer_types=["conv", "full_attention"], num_hidden_layers=2)
    assert [type(m).__name__ for m in model.modules() if mixers.supported(m)] == ["Lfm2ShortConv"]
    assert mixers.packing_blockers(model) == []


def test_a_supported_class_whose_calls_changed_is_refused(monkeypatch):
    """A transformers release whose mixer no longer hands its keyword arguments to the function fastft replaces
    is refused, not trained wrong."""
    model = tiny("qwen3_5_text", **HYBRIDS["qwen3_5_text"])
    mixer = model.model.layers[0].linear_attn
    assert mixers.supported(mixer)
    monkeypatch.setitem(mixers.CALLS, mixers.DELTA_RULE_FN, mixers.re.compile(r"no such call"))
    assert not mixers.supported(mixer)
    with pytest.raises(ValueError, match="Qwen3_5GatedDeltaNet"):
        apply(model)


def tiny(model_type: str, rng=None, **fields):
    """A tiny model of the family, its weights drawn from a seed taken from ``rng`` (the test's, whose seed is
    printed on failure; 0 without one), whatever ran before."""
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **{**common, **fields})
    seed = int(torch.randint(2**31, (), generator=rng)) if rng is not None else 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # convolutions wide enough that a leak shows well above the tolerance
            for module in model.modules():
                if isinstance(module, torch.nn.Conv1d):
                    module.weight.normal_(0, 0.5)
    return model


HYBRIDS = {
    "qwen3_5_text": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    "olmo_hybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        pad_token_id=0,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(
        layer_types=["conv", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        num_dense_layers=0,
    ),
    "qwen3_5_moe_text": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
    # Kimi-Linear's attention layers (MLA) with values of another head dim (8) than queries' (16), as its checkpoints
    "kimi_linear": dict(
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"], linear_num_heads=2,
        linear_head_dim=8, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    ),
    # Mamba-2: 4 heads of 16 (the stock chunk of 4 tokens, so that documents span chunks)
    "bamba": dict(
        attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4
    ),
    "granitemoehybrid": dict(
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
        mamba_chunk_size=4, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16,
    ),
    "falcon_h1": dict(
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4
    ),
    "nemotron_h": dict(
        hybrid_override_pattern="M*", layers_block_type=None, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
        n_groups=2, chunk_size=4,
    ),
    "zamba2": dict(
        layers_block_type=["mamba", "hybrid"], mamba_d_state=8, n_mamba_heads=4, mamba_headdim=16,
        attention_head_dim=16, chunk_size=4, num_mem_blocks=1,
    ),
    "jamba": dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
        mamba_d_state=4, mamba_dt_rank=4, use_mamba_kernels=False,
    ),
    "minimax": dict(
        layer_types=["linear_attention", "full_attention"], block_size=4, num_local_experts=4, num_experts_per_tok=2
    ),
    # pure Mamba stacks: their causal LM and stack hand on no keyword arguments (fastft hands the blocks the info)
    "mamba": dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=4, use_mambapy=False),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, expand=2, chunk_size=4),
    "falcon_mamba": dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=4),
}  # fmt: skip
UNSUPPORTED = {
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=32, attention_window_size=8),
}


@pytest.mark.parametrize("model_type", sorted(UNSUPPORTED))
def test_apply_refuses_packing_and_changes_nothing(model_type):
    model = tiny(model_type, **UNSUPPORTED[model_type])
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="packing=False"):
        apply(model)
    with pytest.raises(ValueError, match="packing=False"):
        use_packed_attention(model)
    assert model.config._attn_implementation == before
    assert "_fastft_state" not in model.__dict__ or not model.__dict__["_fastft_state"]
    apply(model, packing=False, offload_checkpointing=False)  # padded batches stay correct: allowed


def test_a_mixer_that_calls_a_fused_kernel_fastft_does_not_replace_is_refused(monkeypatch):
    """A Mamba mixer whose forward calls mamba_ssm's fused kernels itself (a call fastft does not replace) is
    refused, not trained across documents."""
    model = tiny("bamba", **HYBRIDS["bamba"])
    mixer = model.model.layers[0].mamba
    assert mixers.supported(mixer)
    monkeypatch.setattr(mixers, "UNHANDLED_CALLS", re.compile(r"mamba2_chunk_scan\("))
    with pytest.raises(ValueError, match=r"\bBambaMixer\b"):
        apply(model)


def test_lightning_attention_whose_source_changed_is_refused(monkeypatch):
    """fastft replaces MiniMax's lightning-attention forward: a transformers release whose forward computes
    something else (a line fastft's forward reproduces is gone) is refused."""
    model = tiny("minimax", **HYBRIDS["minimax"])
    assert mixers.supported(model.model.layers[0].self_attn)
    lines = mixers.FORWARD_SOURCE["MiniMaxLightningAttention"]
    monkeypatch.setitem(mixers.FORWARD_SOURCE, "MiniMaxLightningAttention", (*lines, "attn_output = attn_output * 2"))
    with pytest.raises(ValueError, match=r"\bMiniMaxLightningAttention\b"):
        apply(model)


def test_jamba_whose_decoder_layer_changed_is_refused(monkeypatch):
    """Jamba's mixer calls its scan without keyword arguments: fastft hands it the batch's info from the decoder
    layer around it, and refuses the mixer if that layer no longer calls it."""
    model = tiny("jamba", **HYBRIDS["jamba"])
    assert mixers.supported(model.model.layers[0].mamba)
    monkeypatch.setitem(mixers.CONTEXT_LAYERS, "JambaMambaMixer", ("JambaMambaDecoderLayer", re.compile("no such")))
    with pytest.raises(ValueError, match=r"\bJambaMambaMixer\b"):
        apply(model)


def test_a_new_family_is_caught_by_its_modules():
    """No name or layer type gives it away: a convolution along the sequence inside a decoder layer does."""

    class Smoother(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.proj = torch.nn.Linear(width, width)
            self.taps = torch.nn.Conv1d(width, width, kernel_size=3, groups=width, padding=2)

        def forward(self, x):
            return self.taps(self.proj(x).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)

    model = tiny("llama")
    model.model.layers[1].mlp = Smoother(32)
    with pytest.raises(ValueError, match="Smoother"):
        apply(model)


def test_a_new_family_is_caught_by_its_state_parameters():
    model = tiny("llama")
    model.model.layers[0].mlp.register_parameter("A_log", torch.nn.Parameter(torch.zeros(2)))
    blockers = mixers.packing_blockers(model)
    assert [(b.where, b.kind) for b in blockers] == [("layers.0.mlp", "LlamaMLP")]


def test_a_new_layer_type_is_caught_by_the_config():
    model = tiny("llama")
    model.config.layer_types = ["full_attention", "retention"]
    with pytest.raises(ValueError, match="retention"):
        mixers.check_packing(model)


LENGTHS = (7, 1, 13, 3)


def documents(rng, vocab: int, lengths=LENGTHS, device="cpu"):
    """One packed row of documents: its token ids and position ids on ``device``."""
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=rng)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids.to(device), pos.to(device), list(lengths)


def step(model, ids, pos):
    """Loss summed over the tokens (as packing sums the documents' losses) and every trainable gradient."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    keep = pos[0, 1:] != 0  # a document's first token is not predicted from the one before
    (loss * keep).sum().backward()
    return logits[0], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# On a CPU the Triton kernels run in Triton's interpreter, hundreds of times slower: one family per op takes
# them there (the op's own tests cover the kernels), the others the ops' torch paths. A GPU runs every family
# on the kernels.
INTERPRETED = {"qwen3_5_text", "kimi_linear", "bamba", "jamba", "lfm2"}


@pytest.mark.parametrize(
    "model_type, graphs",
    [(m, False) for m in sorted(HYBRIDS)] + [(m, True) for m in ("qwen3_5_text", "lfm2", "jamba")],
)
@pytest.mark.usefixtures("transformers_torch_delta_rule")
def test_packed_equals_each_document_alone(model_type, graphs, rng, device, monkeypatch):
    """Forward and every gradient of a packed row equal those of its documents run one by one."""
    if device.type == "cpu" and (graphs or model_type not in INTERPRETED):
        monkeypatch.setenv("FASTFT_BACKEND", "torch")
    model = tiny(model_type, rng, **HYBRIDS[model_type]).to(device).train()
    stock = copy.deepcopy(model)
    patched = patch_counts()
    apply(model, graphs=graphs) if graphs else apply(model)
    assert model_state_records(model) >= {"mixers"}

    def draw():
        ids, pos, _ = documents(rng, model.config.vocab_size, device=device)
        return dict(input_ids=ids, position_ids=pos)

    batch = testing.clear_of_router_ties(model, draw)  # MoE hybrids: no token near a tie
    ids, pos, lengths = batch["input_ids"], batch["position_ids"], LENGTHS
    stock_logits, _ = step(stock, ids, pos)
    logits, grads = step(model, ids, pos)
    alone_grads = {}
    start = 0
    for n in lengths:
        doc_logits, doc_grads = step(model, ids[:, start : start + n], pos[:, start : start + n])
        torch.testing.assert_close(logits[start : start + n], doc_logits, atol=1e-5, rtol=1e-5)
        for name, g in doc_grads.items():
            alone_grads[name] = alone_grads.get(name, 0) + g
        start += n
    assert grads.keys() == alone_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], alone_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    assert (stock_logits - logits).abs().max() > 1e-4  # stock packing leaks: the comparison can fail
    revert(model)
    assert patch_counts() == patched  # transformers' functions back, unless another live model uses fastft's


def patch_counts() -> dict:
    """How many models use fastft's version of each replaced function of transformers (others' tests included)."""
    return {key: patch.models for key, patch in mixers._patched.items()}


def model_state_records(model) -> set:
    from fastft.integrations.models import model_state

    return set(model_state(model).records)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "jamba", "minimax"])
@pytest.mark.usefixtures("transformers_torch_delta_rule")
def test_another_model_of_the_family_keeps_transformers_path(rng, device, model_type):
    """fastft replaces functions of the family's modeling module (or a class's forward): a model without fastft
    still runs them as transformers wrote them (leaking, as stock does), before and after revert of the one with
    fastft."""
    plain = tiny(model_type, rng, **HYBRIDS[model_type]).to(device)
    ids, pos, _ = documents(rng, plain.config.vocab_size, device=device)
    patched = patch_counts()
    with torch.no_grad():
        expected = plain(input_ids=ids, position_ids=pos, use_cache=False).logits
        fast = apply(tiny(model_type, rng, **HYBRIDS[model_type]).to(device), offload_checkpointing=False)
        torch.testing.assert_close(plain(input_ids=ids, position_ids=pos, use_cache=False).logits, expected)
        fast(input_ids=ids, position_ids=pos, use_cache=False)
        revert(fast)
        torch.testing.assert_close(plain(input_ids=ids, position_ids=pos, use_cache=False).logits, expected)
    assert patch_counts() == patched


def test_attention_that_gets_no_document_boundaries_is_refused(rng):
    """A model whose layers do not hand their keyword arguments to attention (as Moshi's) would attend across
    documents: the attention function refuses instead of taking each row for one document."""
    model = apply(tiny("llama"), offload_checkpointing=False)
    attention = model.model.layers[1].self_attn
    forward = attention.forward

    def forward_without_kwargs(*args, **kwargs):
        kwargs.pop("fastft_packed_info", None)
        kwargs.pop("position_ids", None)
        return forward(*args, **kwargs)

    attention.forward = forward_without_kwargs
    ids, pos, _ = documents(rng, model.config.vocab_size)
    with pytest.raises(ValueError, match="neither the batch's PackedSeqInfo nor position ids"):
        model(input_ids=ids, position_ids=pos)
    revert(model)
    model(input_ids=ids, position_ids=pos)  # the model's own attention again


@pytest.mark.usefixtures("transformers_torch_delta_rule")
def test_replaced_layer_forward_keeps_the_layer_checkpointed(rng, device, monkeypatch):
    """Jamba's Mamba decoder layer, whose forward fastft replaces, is still checkpointed like the others
    (transformers 5.24 checkpoints only through the outermost wrapper of a layer's forward)."""
    monkeypatch.setenv("FASTFT_BACKEND", "torch")  # the checkpointing is under test, not the kernels
    model = apply(tiny("jamba", rng, **HYBRIDS["jamba"]).to(device).train())
    calls = []
    for i, layer in enumerate(model.model.layers):
        function = layer._gradient_checkpointing_func

        def counted(*args, _i=i, _function=function, **kwargs):
            calls.append(_i)
            return _function(*args, **kwargs)

        layer._gradient_checkpointing_func = counted
    ids, pos, _ = documents(rng, model.config.vocab_size, device=device)
    step(model, ids, pos)
    assert sorted(calls) == list(range(len(model.model.layers)))
    assert {type(layer).__name__ for layer in model.model.layers} >= {"JambaMambaDecoderLayer"}
    revert(model)


@pytest.mark.parametrize("model_type, scan", [("mamba", "packed_selective_scan"), ("mamba2", "packed_ssd_scan")])
def test_a_pure_mamba_stack_hands_its_blocks_the_info_and_lets_go(model_type, scan, rng, monkeypatch):
    """Mamba's causal LM and stack hand on no keyword arguments: fastft's packed scan still runs in every block's
    forward and again in its checkpoint's recomputation, and what the hooks hold is let go after the call, also
    when it raises."""
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    model = apply(tiny(model_type, rng, **HYBRIDS[model_type]).train())
    original, calls = getattr(mixer_ops, scan), []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(mixer_ops, scan, counted)
    ids, pos, _ = documents(rng, model.config.vocab_size)
    out = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert len(calls) == model.config.num_hidden_layers
    assert mixer_ops.STACK_INFO.get() is None and mixer_ops.CALL_KWARGS.get() is None
    out.float().sum().backward()
    assert len(calls) == 2 * model.config.num_hidden_layers  # the recomputation ran packed too

    def fails(*args, **kwargs):
        raise RuntimeError("scan failed")

    monkeypatch.setattr(mixer_ops, scan, fails)
    with pytest.raises(RuntimeError, match="scan failed"):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    assert mixer_ops.STACK_INFO.get() is None and mixer_ops.CALL_KWARGS.get() is None
    revert(model)


@pytest.mark.parametrize("model_type", ["mamba", "mamba2", "falcon_mamba"])
def test_a_pure_mamba_stack_keeps_documents_apart_in_a_packed_eval_forward(model_type, rng, monkeypatch):
    """A padding-free evaluation batch (eval mode, no grad: the documents given by position_ids, which the causal
    LM does not hand its stack) is packed too: each document's logits are its own."""
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    model = apply(tiny(model_type, rng, **HYBRIDS[model_type])).eval()
    ids, pos, lengths = documents(rng, model.config.vocab_size)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        start = 0
        for n in lengths:
            alone = model(input_ids=ids[:, start : start + n], position_ids=pos[:, start : start + n], use_cache=False)
            torch.testing.assert_close(packed[start : start + n], alone.logits[0], atol=1e-5, rtol=1e-5)
            start += n
    revert(model)
