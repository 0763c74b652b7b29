"""fastft: Triton kernels, with torch references, for the glue between the big kernels of LLM fine-tuning."""

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path

if _ilu.find_spec(__name__ + ".kernels") is None:
    # Source checkout (not installed): kernels/ beside this package is fastft.kernels, as an install maps it.
    _dir = _Path(__file__).resolve().parent.parent / "kernels"
    _spec = _ilu.spec_from_file_location(
        __name__ + ".kernels", _dir / "__init__.py", submodule_search_locations=[str(_dir)]
    )
    _sys.modules[_spec.name] = _mod = _ilu.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)

from . import copy, dispatch  # noqa: E402
from .attention import packed_attention  # noqa: E402
from .audit import AuditReport, audit  # noqa: E402  (the function shadows the submodule name)
from .balance import BalancedPlan, balance_documents  # noqa: E402
from .conv import packed_conv1d  # noqa: E402
from .delta_rule import gated_delta_rule  # noqa: E402
from .expert_parallel import moe_expert_parallel  # noqa: E402
from .graphs import graphed_checkpoint  # noqa: E402
from .linear_cross_entropy import linear_cross_entropy  # noqa: E402
from .lora import lora_linear  # noqa: E402
from .offload import OffloadConfig, offloaded_checkpoint  # noqa: E402
from .packing import PackedSeqInfo, document_mask_mod, packed_seq_info  # noqa: E402
from .rms_norm import rms_norm  # noqa: E402
from .rotary import rotary  # noqa: E402
from .routing import MoERouting, moe_expert_rows, moe_permute, moe_route, moe_unpermute  # noqa: E402
from .selective_scan import packed_selective_scan  # noqa: E402
from .ssd import packed_ssd_scan  # noqa: E402
from .swiglu import swiglu  # noqa: E402

__version__ = "0.2.0"
__all__ = [
    "PackedSeqInfo",
    "document_mask_mod",
    "packed_seq_info",
    "packed_attention",
    "packed_conv1d",
    "gated_delta_rule",
    "packed_ssd_scan",
    "packed_selective_scan",
    "dispatch",
    "MoERouting",
    "moe_route",
    "moe_permute",
    "moe_unpermute",
    "moe_expert_rows",
    "moe_expert_parallel",
    "swiglu",
    "linear_cross_entropy",
    "rms_norm",
    "rotary",
    "copy",
    "OffloadConfig",
    "offloaded_checkpoint",
    "graphed_checkpoint",
    "lora_linear",
    "audit",
    "AuditReport",
    "balance_documents",
    "BalancedPlan",
]
