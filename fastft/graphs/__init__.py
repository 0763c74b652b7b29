"""CUDA graphs for checkpointed layers: ``fastft.graphed_checkpoint(layer, x, **kwargs)`` is
``fastft.offloaded_checkpoint`` with each layer's forward, and its recompute + backward, replayed as one CUDA
graph each.

- ``checkpoint``: ``graphed_checkpoint``, ``capture_count``, ``layer_graphs`` (re-exported here), the fallbacks;
- ``policy``: when a call captures (its signature) and ``policy="auto"``'s decision per kind of layer;
- ``capture``: capturing and replaying one layer's two graphs for one signature;
- ``memory``: the graph pool, side stream and static buffers every layer and signature shares;
- ``buckets``: the token-count ladder that keeps a packed stream's signatures few.
"""

from .checkpoint import MAX_SIGNATURES as MAX_SIGNATURES
from .checkpoint import capture_count, graphed_checkpoint
from .checkpoint import layer_graphs as layer_graphs

__all__ = ["graphed_checkpoint", "capture_count"]
