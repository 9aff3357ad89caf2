"""Memory accounting, fidelity to the uncompressed run, timing helpers."""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the tensors that exist (``numel * element_size``; views are counted at their own size)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def memory_factor(full_bytes: int, resident_bytes: int) -> float:
    """Uncompressed cache bytes / resident bytes (same dtype); > 1 means memory saved."""
    if resident_bytes <= 0:
        raise ValueError(f"resident_bytes must be positive, got {resident_bytes}.")
    return full_bytes / resident_bytes


def fast_tier_factor(full_bytes: int, resident: dict[str, int] | int) -> float:
    """The ``memory_factor`` every report uses: uncompressed bytes over the bytes resident on the fast tier
    (``resident["device"]``, or an int), ``inf`` when nothing is resident. Slower tiers (a retrieval method's
    offloaded full KV) are reported apart and do not count."""
    held = resident.get("device", 0) if isinstance(resident, dict) else int(resident)
    return full_bytes / held if held > 0 else float("inf")


@dataclass(frozen=True)
class Fidelity:
    """How a compressed output compares with the uncompressed one (token ids)."""

    exact_match: bool
    first_divergence: int | None  # index of the first differing generated token; None if identical
    length_change: int  # len(compressed) - len(reference)
    agreement: float  # fraction of reference positions (up to the shorter length) that agree

    def as_dict(self) -> dict:
        return {"exact_match": self.exact_match, "first_divergence": self.first_divergence,
                "length_change": self.length_change, "agreement": self.agreement}


def fidelity(output_ids: list[int], reference_ids: list[int]) -> Fidelity:
    n = min(len(output_ids), len(reference_ids))
    first = next((i for i in range(n) if output_ids[i] != reference_ids[i]), None)
    if first is None and len(output_ids) != len(reference_ids):
        first = n
    same = sum(a == b for a, b in zip(output_ids, reference_ids))
    agreement = same / len(reference_ids) if reference_ids else float(not output_ids)
    return Fidelity(first is None, first, len(output_ids) - len(reference_ids), agreement)


@contextmanager
def timer(store: dict, key: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        store[key] = store.get(key, 0.0) + time.perf_counter() - t0
