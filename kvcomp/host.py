"""Small integers a decode step already knows on the host, kept with the device tensors built from them.

A decode-time method decides in every layer and step how many tokens each row keeps and whether its store is
over that budget. Read back from the device, those few integers cost a host synchronisation per layer on a GPU;
but they follow from what the host knows anyway: the real tokens each row has seen (the cache counts them), the
slots of a store that holds no empty one. A tensor built from such values carries them (:func:`tensor`,
:func:`known`): :func:`values` returns them without a read and reads the tensor back only where they are not
known (a padded batch). The values describe the tensor as built; the tensors marked here are never written in
place (a budget, a count of seen tokens).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def known(t: torch.Tensor, values: Iterable[int]) -> torch.Tensor:
    """Mark ``t`` with its values (flattened, as Python ints) and return it."""
    t._host_values = tuple(int(v) for v in values)
    return t


_built: dict[tuple, torch.Tensor] = {}  # recent tensor() results: a decode step asks each layer the same budget


def tensor(values: Iterable[int], device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A 1-d tensor of ``values``, marked with them (the same tensor for the same request while it is recent:
    marked tensors are never written in place)."""
    values = tuple(int(v) for v in values)
    key = (values, str(device), dtype)
    out = _built.get(key)
    if out is None:
        if len(_built) >= 64:
            _built.clear()
        out = _built[key] = known(torch.tensor(values, dtype=dtype, device=device), values)
    return out


def known_values(t: torch.Tensor) -> tuple[int, ...] | None:
    """``t``'s values (flattened) when they are known on the host, else None (no read)."""
    return getattr(t, "_host_values", None)


def values(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s values (flattened), without a read when they are known."""
    host = known_values(t)
    return host if host is not None else tuple(t.flatten().tolist())


def offset(t: torch.Tensor, by: int) -> torch.Tensor:
    """``t + by``, still known on the host when ``t`` is."""
    host = known_values(t)
    return t + by if host is None else known(t + by, (v + by for v in host))


def clamp(t: torch.Tensor, low: int | None = None, high: int | None = None) -> torch.Tensor:
    """``t.clamp(low, high)``, still known on the host when ``t`` is."""
    out = t.clamp(min=low, max=high)
    host = known_values(t)
    if host is None:
        return out
    return known(out, (min(high if high is not None else v, max(low if low is not None else v, v)) for v in host))
