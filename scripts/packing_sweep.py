"""Every causal-LM family of the installed transformers, tiny and random on the CPU: does a packed row of two
documents give the second one what it gets alone, stock and after ``apply``? A family ``apply`` accepts must
not leak (nor change what one document alone computes); the others must be refused with a ValueError.

    python3 scripts/packing_sweep.py [model_type ...]   # one line per family; exit 1 if any is wrong after apply

Families whose tiny config does not build or run stock are listed as skipped, with why.
"""

import logging
import os
import signal
import sys
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FASTFT_BACKEND", "torch")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from fastft.integrations.transformers import apply  # noqa: E402

SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, moe_intermediate_size=32, num_experts=4,
    num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16,
    mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4, state_size=8, n_groups=1, num_heads=4, expand=2, conv_kernel=4,
    sliding_window=64, attention_window_size=64,
)  # fmt: skip
TOLERANCE = 1e-4
SECONDS = 90  # per family


def build(model_type: str):
    config_cls = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    try:
        config = config_cls(**SMALL)
    except Exception:
        config = config_cls()
    text = config.get_text_config()
    if text is not config:
        config = type(text)(**SMALL)
    with torch.device("meta"):
        size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if size > 30e6:
        raise RuntimeError(f"{size / 1e6:.0f}M parameters with the small config")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def forwards(model):
    """(second document packed behind a first, the same alone)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, min(model.config.get_text_config().vocab_size, 128), (1, 20), generator=generator)
    pos = torch.cat([torch.arange(7), torch.arange(13)])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, 7:]
        alone = model(input_ids=ids[:, 7:], position_ids=pos[:, 7:], use_cache=False).logits[0]
    return packed, alone


def sweep(model_type: str) -> tuple[str, bool]:
    """One line for the family, and whether fastft is wrong on it."""
    try:
        model = build(model_type)
        stock_packed, stock_alone = forwards(model)
    except Exception as error:
        return f"{model_type:28s} skipped: {type(error).__name__}: {str(error)[:90]}", False
    stock = f"stock leak {(stock_packed - stock_alone).abs().max():.1e}"
    try:
        apply(model, offload_checkpointing=False, lora=False)
        packed, alone = forwards(model)
    except ValueError as error:
        return f"{model_type:28s} {stock}; refused: {str(error)[:90]}", False
    leak = (packed - alone).abs().max().item()
    changed = (alone - stock_alone).abs().max().item()  # fastft must compute what the model computes
    wrong = leak > TOLERANCE or changed > TOLERANCE
    verdict = "WRONG" if wrong else "ok"
    return f"{model_type:28s} {stock}; fastft leak {leak:.1e}, one document vs stock {changed:.1e}: {verdict}", wrong


def main(families) -> int:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()

    def timeout(*_):
        raise TimeoutError(f"over {SECONDS} s")

    signal.signal(signal.SIGALRM, timeout)
    wrong = 0
    for model_type in families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        signal.alarm(SECONDS)
        try:
            line, bad = sweep(model_type)
        except TimeoutError as error:
            line, bad = f"{model_type:28s} skipped: {error}", False
        signal.alarm(0)
        wrong += bad
        print(line, flush=True)
    print(f"{wrong} families wrong after apply")
    return int(wrong > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
