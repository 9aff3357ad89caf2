"""Hot-path kernels: each Triton kernel sits beside a pure-torch implementation with the same signature.

=====================  ==========================================  ==========================================
operation              torch (CPU and the reference)               Triton (CUDA)
=====================  ==========================================  ==========================================
pack / unpack          :mod:`quant_ref`                            :mod:`quant_triton`
quant_attention        :mod:`cpu_native` (fused C, float32) or      :mod:`quant_triton` (fused dequantize,
                       :mod:`quant_cpu` (vectorised torch);         online softmax, split-K, one program per
                       :mod:`quant_ref` is the readable spec        GQA group)
sparse_attention       :mod:`sparse_ref`                           :mod:`sparse_triton`
page_scores            :mod:`cpu_native` (C, float32, group max)    :mod:`retrieval_triton`
                       or :mod:`retrieval_ref`
quant_key_scores       :mod:`retrieval_ref` (SpeCache on the CPU:   :mod:`retrieval_triton`
                       ``cpu_native.quant_key_logits``)
=====================  ==========================================  ==========================================

Dispatch: the functions of this module pick Triton when the tensors are on CUDA and Triton imports, and the
torch implementation otherwise. ``KVCOMP_KERNELS=torch|triton|auto`` (environment) or :func:`use_backend`
overrides the choice; tests force ``triton`` on CPU tensors under ``TRITON_INTERPRET=1`` (which must be set
before Triton is first imported). Triton is imported lazily, so CPU-only use never pays for it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "torch", "triton")
_forced: list[str] = []


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def requested_backend() -> str:
    backend = _forced[-1] if _forced else os.environ.get("KVCOMP_KERNELS", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"KVCOMP_KERNELS must be one of {', '.join(BACKENDS)}; got {backend!r}.")
    return backend


def backend_for(tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: what the functions below run for inputs on ``tensor``'s device."""
    backend = requested_backend()
    if backend == "auto":
        return "triton" if tensor.is_cuda and triton_available() else "torch"
    if backend == "triton" and not (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported.")
    return backend


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Force ``"torch"`` or ``"triton"`` (or ``"auto"``) inside the ``with`` block."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}.")
    _forced.append(backend)
    try:
        yield
    finally:
        _forced.pop()


def _impl(module: str, name: str, tensor: torch.Tensor):
    import importlib

    if backend_for(tensor) == "triton":
        return getattr(importlib.import_module(f"kvcomp.kernels.{module}_triton"), name)
    torch_module = {"quant": "quant_cpu"}.get(module, f"{module}_ref")
    return getattr(importlib.import_module(f"kvcomp.kernels.{torch_module}"), name)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """See :func:`kvcomp.kernels.quant_ref.pack`."""
    return _impl("quant", "pack", codes)(codes, bits)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """See :func:`kvcomp.kernels.quant_ref.unpack`."""
    return _impl("quant", "unpack", packed)(packed, bits)


def quant_attention(q: torch.Tensor, *args, head: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    **kwargs) -> torch.Tensor:
    """See :func:`kvcomp.kernels.quant_ref.quant_attention`. On the CPU, float32 goes to the fused C kernel of
    :mod:`cpu_native` when it compiles (``KVCOMP_NATIVE=0`` turns it off), everything else to
    :mod:`quant_cpu`. ``head`` (keys, values, positions; the attention sinks): full-precision tokens that go
    before the residual ones; the C kernel reads them in place, the others get them concatenated."""
    impl = _impl("quant", "quant_attention", q)
    if backend_for(q) == "torch":
        from kvcomp.kernels import cpu_native

        # args: q_pos, key codes, scale, zero, value codes, scale, zero, positions, residual k, v, pos, bits
        if cpu_native.supports(q, args[5], args[11] if len(args) > 11 else kwargs["bits"], args[2], args[9]):
            return cpu_native.quant_attention(q, *args, head=head, **kwargs)
    if head is not None:
        args = (*args[:8], *(torch.cat([a, b], dim=2) for a, b in zip(head, args[8:11])), *args[11:])
    return impl(q, *args, **kwargs)


def sparse_attention(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """See :func:`kvcomp.kernels.sparse_ref.sparse_attention`."""
    return _impl("sparse", "sparse_attention", q)(q, *args, **kwargs)


def page_scores(q: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor, reduce: str = "max") -> torch.Tensor:
    """See :func:`kvcomp.kernels.retrieval_ref.page_scores`. On the CPU, float32 with ``reduce="max"`` goes to
    the C kernel of :mod:`cpu_native` when it compiles."""
    if backend_for(q) == "torch":
        from kvcomp.kernels import cpu_native

        if cpu_native.supports_pages(q, page_max, page_min, reduce):
            return cpu_native.page_scores(q, page_max, page_min, reduce)
    return _impl("retrieval", "page_scores", q)(q, page_max, page_min, reduce)


def quant_key_scores(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """See :func:`kvcomp.kernels.retrieval_ref.quant_key_scores`."""
    return _impl("retrieval", "quant_key_scores", q)(q, *args, **kwargs)


def speculation_check(qg: torch.Tensor, prev: torch.Tensor, units: torch.Tensor, spec: torch.Tensor,
                      n_units: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`kvcomp.kernels.retrieval_ref.speculation_check`; on the CPU, the C kernel of
    :mod:`cpu_native` when it compiles (one call instead of about ten small torch operations)."""
    from kvcomp.kernels import cpu_native, retrieval_ref

    got = cpu_native.speculation_check(qg, prev, units, spec) if qg.device.type == "cpu" else None
    return got if got is not None else retrieval_ref.speculation_check(qg, prev, units, spec, n_units)


NATIVE_TOP_MIN = 1024  # scores per row from which the native select beats topk + sort on the CPU


def top_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` of the ``k`` largest ``scores`` along the last dimension, in ascending order (so
    selected tokens keep their position order): on the CPU, for rows of at least ``NATIVE_TOP_MIN`` float32
    scores, the native radix select (ties at the k-th value take the lowest indices); otherwise an unsorted
    ``topk`` then a sort of the ``k`` indices. Timed inside decode steps (between a layer's matmuls, where torch's
    small parallel operations pay for waking their threads): at 4,000 scores per row (SpeCache at 4K) the native
    select took 35 us per layer against 87, at 64 (FreeKV's pages at 2K) 19 against 16; alone, in a loop, topk
    + sort wins up to 4K (its fixed cost is lower)."""
    from kvcomp.kernels import cpu_native

    if scores.shape[-1] >= NATIVE_TOP_MIN and cpu_native.supports_top(scores):
        return cpu_native.top_ascending(scores, k)
    return scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
