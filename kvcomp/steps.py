"""Prefill, decode one token, verify a block: the only places that call the model.

In the spirit of gpt-fast (``prefill`` / ``decode_one_token`` / speculative ``verify``, each a small function
over a model and a cache): generation (:mod:`kvcomp.generation`), the shared prefill
(:mod:`kvcomp.shared_prefill`), lossless decoding (:mod:`kvcomp.lossless`) and the benchmark
(``experiments/bench.py``) run the model through these, so positions, masks and stop tokens follow one rule.

Positions (:class:`Rows`). A batch is left-padded block by block (the context, then the question in
query-agnostic mode); each row's real tokens are numbered ``0, 1, ...`` in order, padding gets position 1
(transformers' convention in ``generate``), and every new token continues at its row's own next position.
The attention mask is kept in a preallocated buffer (no ``torch.cat`` per decode step) and handed to the model
only when it is needed: when the new block holds padding, or when the cache is not kvcomp's and earlier blocks
held padding (transformers' own cache masks padded slots with it). A decode step of an unpadded batch passes
no mask at all, so it builds none and reads no tensor on the host.

Linear layers (:func:`native_linears`, opt-in): inside it, a one-token step's linear layers stream their weights
through the native CPU kernel instead of torch's matrix product with one row (42 against 16 GB/s here). Sums
come out in another order, so logits differ from torch's by float rounding: compare runs made the same way.

Stop tokens (:func:`cut_at_stop`): one rule for every decoding loop: a row ends at its first stop token (kept or
dropped as the caller says), and at most ``limit`` tokens.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterable, Iterator

import torch

from kvcomp.cache import CompressedCache

_MASK_HEADROOM = 256  # mask slots allocated beyond the current length (decode steps fill them in place)


class Rows:
    """Per-row bookkeeping of a left-padded batch: the attention mask so far and each row's next position.

    ``mask``: ``[B, T]`` long (1 = real token), a view of a buffer grown geometrically; ``next``: ``[B]`` long,
    the position of each row's next real token; ``padded`` (host): whether any slot so far is padding.
    """

    def __init__(self, batch: int, device, capacity: int = 0):
        self.batch, self.device = batch, torch.device(device)
        self._buffer = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)
        self.length = 0
        self.next = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.padded = False

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> Rows:
        """Rows after a prefilled ``mask`` ``[B, T]`` (one host read: whether it holds padding)."""
        rows = cls(mask.shape[0], mask.device, mask.shape[1] + _MASK_HEADROOM)
        rows._write(mask.to(torch.long))
        rows.next = mask.sum(1).to(torch.long)
        rows.padded = not bool(mask.all())
        return rows

    @property
    def mask(self) -> torch.Tensor:
        return self._buffer[:, : self.length]

    def _write(self, block_mask: torch.Tensor) -> None:
        n = block_mask.shape[1]
        if self.length + n > self._buffer.shape[1]:
            grown = torch.zeros(self.batch, 2 * (self.length + n) + _MASK_HEADROOM, dtype=torch.long,
                                device=self.device)
            grown[:, : self.length] = self.mask
            self._buffer = grown
        self._buffer[:, self.length : self.length + n] = block_mask
        self.length += n

    def add_block(self, block_mask: torch.Tensor | None, n: int | None = None) -> tuple[torch.Tensor, bool]:
        """Positions ``[B, n]`` of a new left-padded block (``block_mask`` ``[B, n]``, None: all real, ``n``
        tokens) and whether it holds padding (host; one read of the block's mask)."""
        if block_mask is None:
            return self.add_tokens(n), False
        block_mask = block_mask.to(device=self.device, dtype=torch.long)
        has_padding = not bool(block_mask.all())
        if not has_padding:
            return self.add_tokens(block_mask.shape[1]), False
        positions = torch.where(block_mask.bool(), self.next.view(-1, 1) + block_mask.cumsum(1) - 1, 1)
        self._write(block_mask)
        self.next = self.next + block_mask.sum(1)
        self.padded = True
        return positions, True

    def add_tokens(self, n: int = 1) -> torch.Tensor:
        """Positions ``[B, n]`` of ``n`` real tokens per row (a decode step, a drafted or verified block)."""
        positions = self.next.view(-1, 1) + torch.arange(n, device=self.device)
        self._write(torch.ones(self.batch, n, dtype=torch.long, device=self.device))
        self.next = self.next + n
        return positions

    def model_mask(self, cache, block_padded: bool) -> torch.Tensor | None:
        """What to pass as ``attention_mask``: the mask when the new block holds padding or a cache that is not
        kvcomp's must mask earlier padding; None otherwise (kvcomp masks stored tokens by their positions)."""
        if block_padded or (self.padded and not isinstance(cache, CompressedCache)):
            return self.mask
        return None


# -- the model calls --------------------------------------------------------------------------------------------
def forward(model, cache, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None, logits_to_keep: int = 1) -> torch.Tensor:
    """One forward of ``input_ids`` ``[B, n]`` over ``cache``; returns the last ``logits_to_keep`` logits
    ``[B, logits_to_keep, V]``."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits


def prefill(model, cache, ids: torch.Tensor, rows: Rows, block_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Feed a prompt block ``ids`` ``[B, n]`` (left-padded as ``block_mask`` says, None: no padding), each row
    continuing at its own next position; returns the logits after it ``[B, V]``."""
    ids = ids.to(rows.device)
    positions, padded = rows.add_block(block_mask, ids.shape[1])
    return forward(model, cache, ids, positions, rows.model_mask(cache, padded))[:, -1]


def decode_one(model, cache, token: torch.Tensor, rows: Rows) -> torch.Tensor:
    """One decode step: ``token`` ``[B]`` at each row's next position; returns the next logits ``[B, V]``."""
    positions = rows.add_tokens(1)
    return forward(model, cache, token.view(-1, 1), positions, rows.model_mask(cache, False))[:, -1]


def verify_block(model, cache, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
    """One forward of ``ids`` ``[B, n]`` (real tokens, e.g. ``[last, d_1 .. d_gamma]`` of speculative decoding) at
    each row's next positions; returns the logits of every position ``[B, n, V]``."""
    positions = rows.add_tokens(ids.shape[1])
    return forward(model, cache, ids, positions, rows.model_mask(cache, False), logits_to_keep=ids.shape[1])


# -- linear layers ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def native_linears(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every ``torch.nn.Linear`` of ``model`` runs a call on one float32 CPU row (a decode step's)
    with :func:`kvcomp.kernels.cpu_native.linear`; any other call (a prefill, a verified block, bfloat16, a GPU)
    goes to torch as before. The modules' own ``forward`` is back on exit."""
    from kvcomp.kernels import cpu_native

    def one_row(module, x):
        if cpu_native.supports_linear(x, module.weight, module.bias):
            return cpu_native.linear(x, module.weight, module.bias)
        return torch.nn.functional.linear(x, module.weight, module.bias)

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and "forward" not in vars(m)]
    for module in linears:
        module.forward = functools.partial(one_row, module)
    try:
        yield
    finally:
        for module in linears:
            del module.forward


# -- stop tokens --------------------------------------------------------------------------------------------------
def cut_at_stop(row: list[int], stop_ids: Iterable[int], keep_stop: bool = False, limit: int | None = None
                ) -> list[int]:
    """``row`` up to ``limit`` tokens, ending before (``keep_stop``: after) its first stop token."""
    stops = set(stop_ids)
    row = row if limit is None else row[:limit]
    cut = next((i for i, t in enumerate(row) if t in stops), None)
    if cut is None:
        return list(row)
    return list(row[: cut + 1 if keep_stop else cut])


def greedy_decode(model, cache, logits: torch.Tensor, rows: Rows, max_new_tokens: int,
                  stop_ids: Iterable[int] = ()) -> tuple[list[list[int]], float, int]:
    """Greedy decoding from the prompt's last logits ``[B, V]`` over ``cache``.

    Returns the generated ids per row cut before the first stop token, the decode seconds and the steps run
    (tokens generated per row, the last step's included). Stops when every row has produced a stop token or
    ``max_new_tokens`` are out; one host read per step (whether every row is done)."""
    stop_ids = set(stop_ids)
    device = logits.device
    batch = logits.shape[0]
    generated = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    steps = 0
    t0 = time.perf_counter()
    for step in range(max_new_tokens):
        next_ids = logits.argmax(-1)
        generated[:, step] = next_ids
        steps = step + 1
        done |= torch.isin(next_ids, stop)
        if step == max_new_tokens - 1 or (stop_ids and bool(done.all())):
            break
        logits = decode_one(model, cache, next_ids, rows)
    seconds = time.perf_counter() - t0
    return [cut_at_stop(r, stop_ids) for r in generated[:, :steps].tolist()], seconds, steps
