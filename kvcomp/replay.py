"""Extra forward passes over a prefilled cache that leave it unchanged (KVzip's context reconstruction).

:func:`replay` runs the model over new token blocks *after* the prefill held by a ``CompressedCache``, each
block attending to every layer's prefilled K/V plus its own (causal) and then forgotten, so the next block sees
the prefill alone again. A callback sees each layer's queries and keys of every block (positions after the
prefill), to score the prefilled tokens by what the block's queries attend to, and may compute the layer's
attention output itself (from the same probabilities) instead of the default dense attention. The replay goes
through the
model's own forward with a second ``CompressedCache`` (kvcomp's attention function, no patching), built from the
first one's states without copying them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcomp.compressor import Capabilities, Compressor, LayerContext
from kvcomp.ops import dense_attention

# callback(layer, q [B, H_q, m, D], ctx, context_kv (keys, values, positions), block_kv (keys, values, positions))
# -> the attention output [B, H_q, m, D], or None for the default (dense over the context and the block).
Observer = Callable[[int, torch.Tensor, LayerContext, tuple, tuple], torch.Tensor | None]


@dataclass
class _Replay(Compressor):
    """State: the prefilled ``(keys, values, positions)``; a block is appended, attended, then dropped."""

    capabilities: ClassVar[Capabilities] = Capabilities(lossy=False)
    sliding_layers: ClassVar[str] = "compress"  # every layer

    def __post_init__(self) -> None:
        self.observer: Observer | None = None

    def append(self, layer, state, k, v, ctx):
        return state, (k, v, ctx.positions)

    def attend(self, layer, state, q, ctx):
        (ck, cv, cpos), (bk, bv, bpos) = state
        if self.observer is not None:
            out = self.observer(layer, q, ctx, (ck, cv, cpos), (bk, bv, bpos))
            if out is not None:
                return out
        keys, values = torch.cat([ck, bk], dim=2), torch.cat([cv, bv], dim=2)
        positions = torch.cat([cpos.to(bpos.dtype), bpos], dim=2)
        out, _ = dense_attention(q, keys, values, ctx.query_positions, positions, ctx.spec)
        return out

    def after_attend(self, layer, state, ctx):
        return state[0]

    def materialize(self, state):
        return state

    def nbytes(self, state) -> dict[str, int]:
        return {"device": sum(t.nbytes for t in state), "host": 0, "disk": 0}


@torch.inference_mode()
def replay(cache, blocks: list[torch.Tensor], observer: Observer) -> None:
    """Run ``cache.model`` over each ``[1, m]`` id block after the prefill of ``cache`` (batch 1), calling
    ``observer`` at every layer; ``cache`` is left as it was."""
    from kvcomp import steps
    from kvcomp.cache import CompressedCache

    model = cache.model
    reader = _Replay()
    reader.observer = observer
    shadow = CompressedCache(model, reader)
    for mine, theirs in zip(shadow.layers, cache.layers):
        keys, values, positions = theirs.compressor.materialize(theirs.state)
        mine.lazy_initialization(keys, values)
        mine.seen_total, mine.seen, mine.next_position = theirs.seen_total, theirs.seen.clone(), theirs.next_position.clone()
        mine.state = (keys, values, positions)
    start = cache.layers[0].next_position.view(1, 1)
    try:
        for ids in blocks:
            positions = start + torch.arange(ids.shape[1], device=ids.device).view(1, -1)
            steps.forward(model, shadow, ids.to(model.device), positions.to(model.device))
            for layer in shadow.layers:  # the next block continues from the prefill again
                layer.seen_total = cache.layers[layer.layer_idx].seen_total
    finally:
        # The shadow cache and its layers reference each other, so the collector, not this return, would free
        # them; until then they would keep the prefill's K/V of every layer alive beside what the caller keeps.
        for layer in shadow.layers:
            layer.state = None
        reader.observer = None

