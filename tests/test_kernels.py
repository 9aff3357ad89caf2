"""Every kernel against its pure-torch reference: Triton (under TRITON_INTERPRET=1 on the CPU, compiled on a
CUDA machine), the vectorised CPU path, and the dispatcher's choice.

Shapes are tiny because the interpreter runs each program in numpy; they are picked to exercise masking:
odd lengths, a head dim that is not a power of two, ragged rows (SENTINEL slots), a query that sees no key,
several sequence splits, GQA ratios 1, 3 and 4.
"""

import os
from pathlib import Path

import pytest
import torch

from kvcomp import kernels
from kvcomp.compressor import SENTINEL
from kvcomp.kernels import cpu_native, quant_cpu, quant_ref, retrieval_ref, sparse_ref
from kvcomp.ops import AttentionSpec, dense_attention, softcap, softmax

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1 before its import", allow_module_level=True)

from kvcomp.kernels import quant_triton, retrieval_triton, sparse_triton  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=gen(seed)).to(DEVICE, dtype)


@pytest.fixture
def many_splits(monkeypatch):
    monkeypatch.setattr(quant_triton, "MIN_SPLIT_TOKENS", 16)


# -- pack / unpack -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", quant_ref.BITS)
def test_pack_unpack_match_reference(bits):
    codes = torch.randint(0, 2**bits, (3, 7, 24), dtype=torch.uint8, generator=gen(bits)).to(DEVICE)
    packed = quant_triton.pack(codes, bits)
    assert torch.equal(packed, quant_ref.pack(codes, bits))
    assert torch.equal(quant_triton.unpack(packed, bits), quant_ref.unpack(packed, bits))
    assert torch.equal(quant_triton.unpack(packed, bits), codes)


# -- quantized decode attention ------------------------------------------------------------------------------
def quant_case(bits, gqa, dtype, d=24, group=8, n_groups=5, residual=6, n=2, seed=0, channels=None):
    """A ragged batch of 2: row 1's last group unused, row 0's last two residual slots empty; row 1's first
    query precedes every key (it sees every slot, as the reference specifies). ``channels``: value channels per
    scale (default 8, or the whole head when 8 does not divide it)."""
    b, h = 2, 2
    k = randn(b, h, n_groups, group, d, seed=seed, dtype=dtype) * 2
    v = randn(b, h, n_groups, group, d, seed=seed + 1, dtype=dtype)
    channels = channels or (8 if d % 8 == 0 else d)
    kc, ks, kz = quant_ref.quantize_keys(k, bits)
    vc, vs, vz = quant_ref.quantize_values(v, bits, channels)
    length = n_groups * group
    positions = torch.arange(length, dtype=torch.int32, device=DEVICE).view(1, 1, n_groups, group).repeat(b, h, 1, 1)
    if n_groups:
        positions[1, :, -1] = SENTINEL
    rk = randn(b, h, residual, d, seed=seed + 2, dtype=dtype)
    rv = randn(b, h, residual, d, seed=seed + 3, dtype=dtype)
    rp = torch.arange(length, length + residual, dtype=torch.int32, device=DEVICE).view(1, 1, -1).repeat(b, h, 1)
    if residual >= 2:
        rp[0, :, -2:] = SENTINEL
    q = randn(b, h * gqa, n, d, seed=seed + 4, dtype=dtype)
    q_pos = torch.tensor([[length // 2 + 1, length + residual][:n], [-1, length + 1][:n]], device=DEVICE)
    return (q, q_pos, kc, ks, kz, vc, vs, vz, positions, rk, rv, rp, bits, d**-0.5)


QUANT_CASES = [  # (bits, gqa, dtype, head dim, residual)
    (4, 1, torch.float32, 24, 6),
    (2, 3, torch.float32, 16, 0),
    (8, 4, torch.float32, 24, 6),
    (4, 3, torch.float16, 16, 5),
    (2, 4, torch.bfloat16, 24, 6),
    (8, 3, torch.bfloat16, 16, 3),
]


@pytest.mark.parametrize("bits,gqa,dtype,d,residual", QUANT_CASES)
def test_triton_quant_attention_matches_reference(bits, gqa, dtype, d, residual, many_splits):
    args = quant_case(bits, gqa, dtype, d=d, residual=residual)
    expected = quant_ref.quant_attention(*args)
    out = quant_triton.quant_attention(*args)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=TOL[dtype] * 4)


def test_quant_attention_with_only_the_residual_window():
    """A prompt shorter than the residual window: no quantized group yet."""
    args = list(quant_case(4, 3, torch.float32, n_groups=0, residual=6))
    args[1] = torch.tensor([[3, 6], [-1, 2]], device=DEVICE)
    expected = quant_ref.quant_attention(*args)
    torch.testing.assert_close(quant_triton.quant_attention(*args), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(quant_cpu.quant_attention(*args), expected, rtol=0, atol=1e-5)
    if DEVICE == "cpu" and cpu_native.load() is not None:
        torch.testing.assert_close(cpu_native.quant_attention(*args), expected, rtol=0, atol=1e-5)


def test_triton_quant_attention_splits_the_sequence(many_splits):
    n_splits, per_split = quant_triton.split_plan(40, 4, 16)
    assert n_splits == 3 and per_split == 16
    n_splits, per_split = quant_triton.split_plan(128 * 1024, 8, 64)  # a long context fills the GPU
    assert n_splits * 8 >= quant_triton.TARGET_PROGRAMS // 2 and per_split % 64 == 0


@pytest.mark.parametrize("bits,gqa,dtype,d,residual", QUANT_CASES)
@pytest.mark.parametrize("block_tokens", [8, 1024])
def test_cpu_quant_attention_matches_reference(bits, gqa, dtype, d, residual, block_tokens):
    args = quant_case(bits, gqa, dtype, d=d, residual=residual, seed=3)
    expected = quant_ref.quant_attention(*args)
    out = quant_cpu.quant_attention(*args, block_tokens=block_tokens)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=TOL[dtype] * 4)


def test_cpu_quant_attention_one_query_no_mask_and_odd_value_groups():
    """Decode of one row with every slot visible (the path without a mask) and value groups of 4 channels
    (several per bit plane)."""
    b, h, g, d, group, n_groups = 1, 2, 3, 16, 8, 3
    k, v = randn(b, h, n_groups, group, d, seed=5), randn(b, h, n_groups, group, d, seed=6)
    kc, ks, kz = quant_ref.quantize_keys(k, 2)
    vc, vs, vz = quant_ref.quantize_values(v, 2, 4)
    positions = torch.arange(n_groups * group, dtype=torch.int32, device=DEVICE).view(1, 1, n_groups, group)
    positions = positions.repeat(b, h, 1, 1)
    empty = randn(b, h, 0, d)
    args = (randn(b, h * g, 1, d, seed=7), torch.tensor([[30]], device=DEVICE), kc, ks, kz, vc, vs, vz, positions,
            empty, empty, torch.zeros(b, h, 0, dtype=torch.int32, device=DEVICE), 2, 0.25)
    torch.testing.assert_close(quant_cpu.quant_attention(*args), quant_ref.quant_attention(*args), rtol=0, atol=1e-5)


def test_cpu_quant_attention_reuses_one_workspace():
    args = quant_case(4, 3, torch.float32)
    quant_cpu._workspace.clear()
    quant_cpu.quant_attention(*args, block_tokens=16)
    buffers = dict(quant_cpu._workspace)
    quant_cpu.quant_attention(*args, block_tokens=16)
    assert all(quant_cpu._workspace[key] is buf for key, buf in buffers.items())
    (key,) = [key for key in buffers if key[1] == torch.float32]
    assert buffers[key].numel() <= 2 * 2 * 16 * 24  # one block (two groups of 8) of [B, H, T, D]


# -- sparse attention ----------------------------------------------------------------------------------------
def sparse_case(gqa, dtype, page_size, length=37, selected=5, d=24, seed=0):
    b, h = 2, 2
    q = randn(b, h * gqa, 1, d, seed=seed, dtype=dtype)
    keys = randn(b, h, length, d, seed=seed + 1, dtype=dtype)
    values = randn(b, h, length, d, seed=seed + 2, dtype=dtype)
    pages = -(-length // page_size)
    indices = torch.stack([torch.randperm(pages, generator=gen(seed + i))[:selected] for i in range(b * h)])
    indices = indices.view(b, h, selected).to(DEVICE)
    indices[0, 1, -1] = -1  # an unused slot
    indices[1, 0, 0] = pages - 1  # the last page, clipped at `length`
    return q, keys, values, indices, d**-0.5, page_size


@pytest.mark.parametrize("gqa,dtype,page_size", [
    (1, torch.float32, 1), (3, torch.float32, 4), (4, torch.float16, 1), (3, torch.bfloat16, 8),
])
def test_triton_sparse_attention_matches_reference(gqa, dtype, page_size, many_splits):
    args = sparse_case(gqa, dtype, page_size)
    expected = sparse_ref.sparse_attention(*args)
    out = sparse_triton.sparse_attention(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=TOL[dtype] * 4)


def test_sparse_reference_over_every_token_is_dense_attention():
    q, keys, values, _, scaling, _ = sparse_case(3, torch.float32, 1, length=20)
    everything = torch.arange(20, device=DEVICE).view(1, 1, 20).expand(2, 2, 20)
    out = sparse_ref.sparse_attention(q, keys, values, everything, scaling)
    positions = torch.arange(20, device=DEVICE).view(1, 1, 20).expand(2, 2, 20)
    expected, _ = dense_attention(q, keys, values, torch.full((2, 1), 20, device=DEVICE), positions, AttentionSpec(scaling))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    pages = torch.arange(5, device=DEVICE).view(1, 1, 5).expand(2, 2, 5)  # 5 pages of 4 = the same tokens
    torch.testing.assert_close(sparse_ref.sparse_attention(q, keys, values, pages, scaling, 4), out)


def test_sparse_attention_with_nothing_selected_is_zero():
    q, keys, values, indices, scaling, _ = sparse_case(1, torch.float32, 1)
    indices = torch.full_like(indices, -1)
    assert not sparse_ref.sparse_attention(q, keys, values, indices, scaling).any()
    assert not sparse_triton.sparse_attention(q, keys, values, indices, scaling).any()


# -- retrieval scoring ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("gqa,dtype,reduce", [
    (1, torch.float32, "max"), (3, torch.float32, "sum"), (4, torch.float16, "mean"), (3, torch.bfloat16, "max"),
])
def test_triton_page_scores_match_reference(gqa, dtype, reduce):
    b, h, pages, d = 2, 2, 37, 24
    q = randn(b, h * gqa, 1, d, seed=1, dtype=dtype)
    keys = randn(b, h, pages, 4, d, seed=2, dtype=dtype)
    page_max, page_min = keys.amax(3), keys.amin(3)
    expected = retrieval_ref.page_scores(q, page_max, page_min, reduce)
    out = retrieval_triton.page_scores(q, page_max, page_min, reduce)
    assert out.dtype == torch.float32 and out.shape == (b, h, pages)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_page_score_bounds_every_key_of_the_page():
    q = randn(1, 6, 1, 16, seed=3)
    keys = randn(1, 2, 9, 4, 16, seed=4)  # 9 pages of 4 keys
    bound = retrieval_ref.page_scores(q, keys.amax(3), keys.amin(3), "max")
    logits = torch.einsum("bhgd,bhptd->bhgpt", q.view(1, 2, 3, 16), keys).amax(dim=(2, 4))
    assert bool((logits <= bound + 1e-5).all())


@pytest.mark.parametrize("b,gqa,pages,d", [(1, 3, 62, 64), (2, 1, 1, 24), (1, 4, 255, 64), (1, 2, 0, 16)])
def test_native_page_scores_match_reference(b, gqa, pages, d):
    """The C page bound, maximized over the query group, against the reference; digests that are views of a
    longer one (FreeKV's grow by cat; a slice is not contiguous) are read through their own strides."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    h = 3
    q = randn(b, h * gqa, 1, d, seed=40).cpu()
    keys = randn(b, h, pages + 2, 8, d, seed=41).cpu()
    page_max, page_min = keys.amax(3)[:, :, 1:-1], keys.amin(3)[:, :, 1:-1]
    assert cpu_native.supports_pages(q, page_max, page_min, "max")
    out = cpu_native.page_scores(q, page_max, page_min)
    assert out.shape == (b, h, pages) and out.dtype == torch.float32
    torch.testing.assert_close(out, retrieval_ref.page_scores(q, page_max, page_min, "max"), rtol=1e-5, atol=1e-5)


def test_page_scores_dispatch_goes_native_only_for_the_group_maximum(monkeypatch):
    q = randn(1, 6, 1, 16, seed=42).cpu()
    keys = randn(1, 2, 9, 4, 16, seed=43).cpu()
    calls = []
    native = cpu_native.page_scores
    monkeypatch.setattr(cpu_native, "page_scores", lambda *a: calls.append(1) or native(*a))
    for reduce in ("max", "sum", "mean"):
        got = kernels.page_scores(q, keys.amax(3), keys.amin(3), reduce)
        torch.testing.assert_close(got, retrieval_ref.page_scores(q, keys.amax(3), keys.amin(3), reduce),
                                   rtol=1e-5, atol=1e-5)
    assert calls == ([1] if cpu_native.load() is not None else [])
    monkeypatch.setenv("KVCOMP_NATIVE", "0")
    kernels.page_scores(q, keys.amax(3), keys.amin(3), "max")
    assert len(calls) <= 1


@pytest.mark.parametrize("bits,gqa,dtype,reduce", [
    (2, 1, torch.float32, "max"), (4, 3, torch.float32, "sum"), (8, 4, torch.float16, "mean"),
    (4, 3, torch.bfloat16, "max"),
])
def test_triton_quant_key_scores_match_reference(bits, gqa, dtype, reduce):
    b, h, n_groups, group, d = 2, 2, 3, 8, 24
    q = randn(b, h * gqa, 1, d, seed=5, dtype=dtype)
    kc, ks, kz = quant_ref.quantize_keys(randn(b, h, n_groups, group, d, seed=6, dtype=dtype), bits)
    expected = retrieval_ref.quant_key_scores(q, kc, ks, kz, bits, 0.5, reduce)
    out = retrieval_triton.quant_key_scores(q, kc, ks, kz, bits, 0.5, reduce)
    assert out.shape == (b, h, n_groups * group)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_quant_key_scores_reference_is_attention_logits_at_8_bits():
    q = randn(1, 4, 1, 16, seed=8)
    k = randn(1, 2, 2, 8, 16, seed=9)
    scores = retrieval_ref.quant_key_scores(q, *quant_ref.quantize_keys(k, 8), 8, 0.25, "sum")
    exact = (torch.einsum("bhgd,bhtd->bhgt", q.view(1, 2, 2, 16), k.flatten(2, 3)) * 0.25).sum(2)
    torch.testing.assert_close(scores, exact, rtol=0, atol=0.02)


# -- dispatch ------------------------------------------------------------------------------------------------
def test_dispatcher_picks_torch_on_cpu_and_triton_when_forced(monkeypatch):
    monkeypatch.delenv("KVCOMP_KERNELS", raising=False)
    cpu = torch.zeros(1)
    assert kernels.backend_for(cpu) == "torch"
    assert kernels._impl("quant", "quant_attention", cpu) is quant_cpu.quant_attention
    assert kernels._impl("sparse", "sparse_attention", cpu) is sparse_ref.sparse_attention
    assert kernels._impl("retrieval", "page_scores", cpu) is retrieval_ref.page_scores
    if DEVICE == "cuda":
        assert kernels.backend_for(torch.zeros(1, device="cuda")) == "triton"
    else:
        with kernels.use_backend("triton"):
            assert kernels._impl("quant", "pack", cpu) is quant_triton.pack
            args = sparse_case(3, torch.float32, 2)
            torch.testing.assert_close(kernels.sparse_attention(*args), sparse_ref.sparse_attention(*args),
                                       rtol=0, atol=1e-4)
    monkeypatch.setenv("KVCOMP_KERNELS", "torch")
    assert kernels.backend_for(cpu) == "torch"
    monkeypatch.setenv("KVCOMP_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVCOMP_KERNELS"):
        kernels.backend_for(cpu)


def test_dispatcher_sends_float32_cpu_quant_attention_to_the_native_kernel(monkeypatch):
    args = quant_case(4, 3, torch.float32)
    if DEVICE != "cpu" or not cpu_native.supports(args[0], args[6], 4, args[3]):
        pytest.skip("no C compiler (the torch path is used)")
    calls = []
    native = cpu_native.quant_attention
    monkeypatch.setattr(cpu_native, "quant_attention", lambda *a, **k: calls.append(1) or native(*a, **k))
    out = kernels.quant_attention(*args)
    assert calls == [1]
    torch.testing.assert_close(out, quant_ref.quant_attention(*args), rtol=0, atol=1e-5)
    monkeypatch.setenv("KVCOMP_NATIVE", "0")
    kernels.quant_attention(*args)
    assert calls == [1]


@pytest.mark.parametrize("bits,gqa,d,residual,n,channels,group", [
    (4, 3, 24, 6, 2, None, 8), (2, 4, 16, 0, 2, None, 8), (8, 1, 24, 5, 2, None, 8), (4, 3, 64, 6, 1, None, 8),
    (2, 7, 16, 3, 1, None, 8),
    # value scales over 32 channels, as the compressor's default group_size gives: the kernel's vector path
    # (16 columns per vector, each inside one scale's channels) for D = 64, 128 and 256
    (4, 3, 64, 6, 1, 32, 8), (8, 4, 128, 5, 2, 32, 8), (4, 4, 256, 6, 1, 32, 8), (4, 1, 64, 0, 2, 64, 8),
    # groups of 16 and 32 tokens: the keys' sixteen-tokens-per-vector path at 2, 4 and 8 bits (rows 3, 6, 1, 4, 10)
    (2, 3, 64, 6, 1, 64, 16), (2, 3, 64, 6, 2, 32, 32), (2, 1, 128, 0, 1, None, 16), (8, 4, 64, 5, 1, 64, 16),
    (4, 5, 128, 6, 2, 32, 32),
    # whole vectors per value scale (the values' register path) at D = 64: one scale per token at 2, 4 and 8 bits
    # with rows 1, 3, 4 and 5 (4 + 1); two (4 and 8 bits) and four (8 bits) scales per token
    (2, 1, 64, 6, 1, 64, 8), (4, 3, 64, 6, 1, 64, 16), (8, 2, 64, 3, 2, 64, 8), (2, 5, 64, 0, 1, 64, 8),
    (4, 2, 64, 6, 2, 32, 8), (8, 5, 64, 0, 1, 32, 8), (8, 4, 64, 5, 1, 16, 8),
    # one scale per token at D = 128 and 256 (the buffered vector path)
    (2, 4, 256, 6, 1, 256, 8), (4, 3, 128, 0, 1, 128, 8), (2, 5, 128, 6, 1, 128, 16),
])
def test_native_cpu_quant_attention_matches_reference(bits, gqa, d, residual, n, channels, group):
    """Query rows (G x n) of 6, 8, 2, 3 and 7 exercise the kernel's row blocking; D = 64 its unrolled path."""
    if DEVICE != "cpu" or cpu_native.load() is None:
        pytest.skip("no C compiler")
    args = quant_case(bits, gqa, torch.float32, d=d, residual=residual, n=n, seed=11, channels=channels,
                      group=group, n_groups=5 if group < 32 else 3)
    torch.testing.assert_close(cpu_native.quant_attention(*args), quant_ref.quant_attention(*args),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("bits,gqa,d,residual,n,channels,group", [
    (4, 3, 24, 6, 2, None, 8), (4, 3, 64, 6, 1, 32, 8), (2, 5, 64, 3, 1, 64, 16)])
def test_quant_attention_reads_the_sinks_in_place_as_if_concatenated(monkeypatch, bits, gqa, d, residual, n,
                                                                     channels, group):
    """``head`` (the quant compressor's attention sinks, ahead of its window): the C kernel reads them where they
    are and gives exactly what it gives for the concatenation; the torch path concatenates them."""
    if DEVICE != "cpu" or cpu_native.load() is None:
        pytest.skip("no C compiler")
    args = quant_case(bits, gqa, torch.float32, d=d, residual=residual, n=n, seed=5, channels=channels, group=group,
                      n_groups=3)
    head, tail = tuple(t[:, :, :2] for t in args[9:12]), tuple(t[:, :, 2:] for t in args[9:12])
    split = (*args[:9], *tail, *args[12:])
    expected = cpu_native.quant_attention(*args)
    assert torch.equal(kernels.quant_attention(*split, head=head), expected)
    monkeypatch.setenv("KVCOMP_NATIVE", "0")
    torch.testing.assert_close(kernels.quant_attention(*split, head=head), quant_ref.quant_attention(*args),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("bits,gqa,d,n,group", [
    (2, 3, 64, 1, 8), (4, 4, 24, 2, 8), (1, 3, 64, 1, 8), (8, 1, 16, 1, 8),
    # sixteen tokens per vector (1 and 2 bits, groups of 16k tokens, 16k bytes per token): rows 3, 5 (4 + 1), 1
    (2, 3, 64, 1, 16), (2, 5, 64, 1, 32), (2, 1, 128, 1, 16), (1, 3, 128, 1, 64), (1, 2, 128, 2, 16),
])
def test_native_quant_key_logits_are_the_dequantized_keys_logits(bits, gqa, d, n, group):
    """Every quantized key's scaled logit for every query row (m = head-in-group * n + query), 1 bit included."""
    if DEVICE != "cpu" or cpu_native.load() is None:
        pytest.skip("no C compiler")
    b, h, n_groups = 2, 2, 3
    q = randn(b, h * gqa, n, d, seed=21)
    kc, ks, kz = quant_ref.quantize_keys(randn(b, h, n_groups, group, d, seed=22), bits)
    keys = quant_ref.dequantize_keys(kc, ks, kz, bits, torch.float32).flatten(2, 3)
    expected = torch.matmul(q.reshape(b, h, gqa * n, d), keys.transpose(-1, -2)) * 0.3
    out = cpu_native.quant_key_logits(q, kc, ks, kz, bits, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    if n == 1:  # the group maximum is the reference's retrieval score
        torch.testing.assert_close(out.amax(2), retrieval_ref.quant_key_scores(q, kc, ks, kz, bits, 0.3, "max"),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits,gqa,d,residual,n", [(4, 3, 24, 6, 2), (2, 3, 64, 6, 1)])
def test_native_quant_attention_reuses_given_key_logits_exactly(bits, gqa, d, residual, n):
    """Logits passed in (as SpeCache passes its scoring logits) give the same attention as logits computed from
    the codes, masking (ragged rows, a blind query) included; garbage codes show they are not read again."""
    if DEVICE != "cpu" or cpu_native.load() is None:
        pytest.skip("no C compiler")
    args = list(quant_case(bits, gqa, torch.float32, d=d, residual=residual, n=n, seed=13))
    scaling = args[13] if len(args) > 13 else 1.0
    logits = cpu_native.quant_key_logits(args[0], args[2], args[3], args[4], bits, scaling)
    expected = cpu_native.quant_attention(*args)
    args[2] = torch.randint_like(args[2], 0, 255)
    torch.testing.assert_close(cpu_native.quant_attention(*args, key_logits=logits), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="key_logits"):
        cpu_native.quant_attention(*args, key_logits=logits[:, :1])


# -- top-k in ascending order ------------------------------------------------------------------------------------
def test_native_top_ascending_breaks_ties_by_lowest_index():
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, -0.0, float("-inf"), float("nan"), 5.0]])
    assert cpu_native.top_ascending(scores, 2).tolist() == [[1, 2], [3, 4]]  # NaN ranks above +inf, as topk
    assert cpu_native.top_ascending(scores, 5).tolist() == [[0, 1, 2, 3, 4]] * 2
    assert cpu_native.top_ascending(scores, 0).shape == (2, 0)
    with pytest.raises(ValueError, match="k=6"):
        cpu_native.top_ascending(scores, 6)


@pytest.mark.parametrize("kind", ["normal", "ties", "infinities", "huge", "one-ulp apart"])
def test_native_top_ascending_keeps_the_k_largest_in_order(kind):
    """Against torch.topk on rows whose k-th value falls anywhere in the radix select's three passes."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    g = gen(31)
    for _ in range(40):
        rows, length = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 3000, (1,), generator=g))
        k = int(torch.randint(0, length + 1, (1,), generator=g))
        s = torch.randn(rows, length, generator=g)
        if kind == "ties":
            s = torch.randint(0, 5, (rows, length), generator=g).float()
        elif kind == "infinities":
            s = s.masked_fill(s > 1.5, float("inf")).masked_fill(s < -1.5, float("-inf"))
        elif kind == "huge":
            s = s * 1e30
        elif kind == "one-ulp apart":
            s = 0.5 + torch.randint(0, 3, (rows, length), generator=g) * 2.0**-24  # 0.5 plus 0, 1 or 2 ulps
        got = cpu_native.top_ascending(s.view(rows, 1, length), k).view(rows, k)
        assert (got.diff(dim=-1) > 0).all()
        assert torch.equal(s.gather(-1, got).sort(dim=-1, descending=True).values, s.topk(k, dim=-1).values)


def test_top_ascending_dispatch_gives_the_same_selection_native_or_torch(monkeypatch):
    """Long float32 rows go to the native select, short ones and other dtypes to topk + sort: same indices."""
    scores = randn(2, 3, kernels.NATIVE_TOP_MIN, seed=32).cpu()
    calls = []
    native = cpu_native.top_ascending
    monkeypatch.setattr(cpu_native, "top_ascending", lambda *a: calls.append(1) or native(*a))
    got = kernels.top_ascending(scores, 37)
    assert calls == ([1] if cpu_native.supports_top(scores) else [])
    torch.testing.assert_close(got, kernels.top_ascending(scores.double(), 37), rtol=0, atol=0)  # float64: torch
    short = scores[..., : kernels.NATIVE_TOP_MIN - 1]
    torch.testing.assert_close(kernels.top_ascending(short, 37), native(short, 37), rtol=0, atol=0)
    assert len(calls) == 1  # the short rows did not go native


# -- float decode attention ------------------------------------------------------------------------------------
def _decode_reference(qg, k, v, spec):
    """The layer's attention (kvcomp.ops: scale, soft-cap, softmax with sinks) in float64."""
    sinks = spec.grouped_sinks(k.shape[1], 1)
    logits = softcap(torch.matmul(qg.double(), k.double().transpose(-1, -2)) * spec.scaling, spec.softcap)
    probs = softmax(logits, None if sinks is None else sinks.double())
    return torch.matmul(probs, v.double()), probs


@pytest.mark.parametrize("length", [1, 255, 256, 257, 1000])
@pytest.mark.parametrize("rows,d,cap,sinks", [(3, 64, None, False), (1, 24, None, False), (5, 64, 5.0, True),
                                           (4, 64, None, True)])
def test_native_decode_attention_matches_reference_on_store_views(length, rows, d, cap, sinks):
    """Keys and values as a growable store holds them (views of buffers with spare slots, so batch and head
    strides are not those of a contiguous tensor); soft-capping and sinks as the layer applies them."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    b, h = 2, 3
    buf_k, buf_v = randn(b, h, length + 9, d, seed=40).cpu(), randn(b, h, length + 9, d, seed=41).cpu()
    k, v = buf_k[:, :, 4:4 + length], buf_v[:, :, 4:4 + length]
    qg = randn(b, h, rows, d, seed=42).cpu() * 2
    spec = AttentionSpec(scaling=d ** -0.5, softcap=cap,
                         sinks=randn(h * rows, seed=43).cpu() if sinks else None)
    assert cpu_native.supports_decode(qg, k, v) and not k.is_contiguous()
    out, probs = cpu_native.decode_attention(qg, k, v, spec.scaling, spec.softcap, spec.grouped_sinks(h, 1))
    ref_out, ref_probs = _decode_reference(qg, k, v, spec)
    torch.testing.assert_close(probs.double(), ref_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


def _same_alone_on_one_thread(kernel, *tensors) -> None:
    """``kernel(*tensors, 0.125)`` (a pair of results) on a batch of 3 with 2 threads, then on row 1 alone with
    1 thread: row 1's results equal bit for bit."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = kernel(*tensors, 0.125)
        torch.set_num_threads(1)
        alone = kernel(*(t[1:2] for t in tensors), 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch[0][1:2], alone[0]) and torch.equal(batch[1][1:2], alone[1])


def test_native_decode_attention_row_is_the_same_alone_in_a_batch_and_on_any_thread_count():
    """Bit for bit: its work items (KV head x 256-token chunk) do not depend on the batch or the threads."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    k, v, qg = randn(3, 3, 700, 64, seed=44).cpu(), randn(3, 3, 700, 64, seed=45).cpu(), randn(3, 3, 3, 64, seed=46).cpu()
    _same_alone_on_one_thread(cpu_native.decode_attention, qg, k, v)


def _prompt_reference(q, k, v, scaling):
    b, hq, n, d = q.shape
    h = k.shape[1]
    logits = torch.matmul(q.double().view(b, h, hq // h * n, d), k.double().transpose(-1, -2)) * scaling
    causal = torch.ones(n, n, dtype=torch.bool).tril().repeat(hq // h, 1)
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
    return probs.sum(2), torch.matmul(probs, v.double()).view(b, hq, n, d)


@pytest.mark.parametrize("b,hq,h,n,d", [(1, 9, 3, 300, 64), (2, 4, 1, 33, 256), (1, 2, 2, 16, 16), (1, 6, 2, 5, 32),
                                        (2, 8, 8, 97, 128)])
def test_native_prompt_attention_matches_reference(b, hq, h, n, d):
    """The keys each query sees (its own and earlier ones), blocks of 16 queries with a partial last one, any
    group size and head width of whole vectors; the attention each key receives and the output."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    q, k, v = randn(b, hq, n, d, seed=60).cpu() * 2, randn(b, h, n, d, seed=61).cpu(), randn(b, h, n, d, seed=62).cpu()
    assert cpu_native.supports_prompt(q, k, v)
    received, out = cpu_native.prompt_attention(q, k, v, d ** -0.5)
    want_received, want_out = _prompt_reference(q, k, v, d ** -0.5)
    torch.testing.assert_close(received.double(), want_received, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    only, none = cpu_native.prompt_attention(q, k, None, d ** -0.5)
    assert none is None and torch.equal(only, received)


@pytest.mark.parametrize("nc,n,d", [(40, 33, 64), (16, 5, 16), (3, 17, 128)])
def test_native_prompt_attention_over_a_context_every_query_sees(nc, n, d):
    """With context keys before the block's own (KVzip's repetition over a prefilled context): the received
    attention of both, and the output, against the whole probability matrix (context padding never counted)."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    b, hq, h = 1, 6, 2
    q, k, v = randn(b, hq, n, d, seed=66).cpu() * 2, randn(b, h, n, d, seed=67).cpu(), randn(b, h, n, d, seed=68).cpu()
    ck, cv = randn(b, h, nc, d, seed=69).cpu(), randn(b, h, nc, d, seed=70).cpu()
    received, out = cpu_native.prompt_attention(q, k, v, d ** -0.5, (ck, cv))
    g = hq // h
    logits = torch.matmul(q.double().view(b, h, g * n, d), torch.cat([ck, k], 2).double().transpose(-1, -2)) * d ** -0.5
    seen = torch.cat([torch.ones(n, nc, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1).repeat(g, 1)
    probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1)
    torch.testing.assert_close(received.double(), probs.sum(2), rtol=1e-5, atol=1e-5)
    want = torch.matmul(probs, torch.cat([cv, v], 2).double()).view(b, hq, n, d)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    scores, same = cpu_native.reconstruction_attention(q, k, v, d ** -0.5, (ck, cv), 1, 2, nc)
    torch.testing.assert_close(same, out)  # the same probabilities, another statistic
    kept = torch.ones(nc + n, dtype=torch.bool)
    kept[1] = False  # neither protected (key 0) nor scored (keys 2..nc-1): out of the renormalising sum
    renormalised = probs / (probs * kept).sum(-1, keepdim=True)
    torch.testing.assert_close(scores.double(), renormalised[..., 2:nc].amax(2), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="context keys"):
        cpu_native.reconstruction_attention(q, k, v, d ** -0.5, (ck, cv), 2, 5, nc + 1)


def test_native_prompt_attention_is_the_same_alone_in_a_batch_and_on_any_thread_count():
    """Bit for bit: the received attention is summed in waves of a fixed size and a fixed order."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    q, k, v = randn(3, 6, 200, 64, seed=63).cpu(), randn(3, 2, 200, 64, seed=64).cpu(), randn(3, 2, 200, 64, seed=65).cpu()
    _same_alone_on_one_thread(cpu_native.prompt_attention, q, k, v)
    assert not cpu_native.supports_prompt(q[..., :8], k[..., :8], v[..., :8])  # not whole vectors: torch
    assert not cpu_native.supports_prompt(q.bfloat16(), k.bfloat16(), v.bfloat16())


def test_kernel_benchmark_script_runs_at_tiny_size(tmp_path):
    from experiments import kernel_bench

    assert kernel_bench.main(["--tiny", "--out", str(tmp_path)]) == 0
    import json

    result = json.loads((tmp_path / "kernel_bench.json").read_text())
    kinds = {row["kernel"] for row in result["rows"]}
    assert kinds == {"quant4-ieee", "quant4-tf32", "sparse-1/4", "dense-sdpa-bf16", "key-scores2", "page-scores"}
    assert all(row["max_abs_err"] < 0.05 and row["gb_s"] > 0 for row in result["rows"])


def test_native_kernel_ab_times_both_checkouts_on_the_same_results(tmp_path):
    """The A/B script against a checkout whose kernel lacks top_ascending, decode_attention and page_scores (it
    times topk + sort, sdpa or matmul-softmax-matmul, and the torch page bound there), at a tiny size; a path that
    is no checkout is refused by name."""
    from experiments import native_kernel_ab

    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    base = tmp_path / "base" / "kvcomp" / "kernels"
    base.mkdir(parents=True)
    source = Path(cpu_native.__file__).read_text()
    (base / "cpu_native.py").write_text(source.replace("def top_ascending(", "def _no_top_ascending(")
                                        .replace("def decode_attention(", "def _no_decode_attention(")
                                        .replace("def page_scores(", "def _no_page_scores("))
    (base.parent / "tiers.py").write_text((Path(cpu_native.__file__).parent.parent / "tiers.py").read_text())
    result = native_kernel_ab.main(["--base", str(tmp_path / "base"), "--contexts", "256", "--rounds", "1",
                                    "--calls", "2", "--out", str(tmp_path / "out")])
    times = result["contexts"][256]
    assert set(times) == {"quant_attention 2-bit", "quant_attention 4-bit", "quant_key_logits 2-bit", "top-k ascending",
                          "decode attention", "decode attention + weights", "page scores", "disk gather"}
    assert all(len(t["this"]) == len(t["base"]) == 1 and min(t["this"] + t["base"]) > 0 for t in times.values())
    assert (tmp_path / "out" / "native_kernel_ab.json").is_file()
    with pytest.raises(SystemExit, match="not a kvcomp checkout"):
        native_kernel_ab.main(["--base", str(tmp_path), "--out", str(tmp_path / "out")])


def test_forcing_triton_without_cuda_or_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with kernels.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.backend_for(torch.zeros(1))


@pytest.mark.parametrize("order", ["ascending", "any"])
def test_native_speculation_check_equals_the_torch_reference(order):
    """Held units, recall and the query cosine of a speculative prefetch, from one C call, against
    retrieval_ref: selections ascending (a merge) or in any order (every pair), -1 slots, no units at all."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    g = gen(41)
    for k, k2 in ((8, 8), (5, 9), (0, 4), (30, 3)):
        def rows(n):  # distinct units per (row, KV head), as a selection has them
            return torch.stack([torch.randperm(40, generator=g)[:n] for _ in range(6)]).view(2, 3, n)

        units, spec = rows(k), rows(k2)
        if order == "ascending":
            units, spec = units.sort(dim=-1).values, spec.sort(dim=-1).values
        else:
            units[..., :1] = -1
            spec[0, 1, -1] = -1
        qg, prev = torch.randn(2, 3, 4, 16, generator=g), torch.randn(2, 3, 4, 16, generator=g)
        prev[1, 2] = qg[1, 2] * 3.0  # the same direction: cosine 1
        got = cpu_native.speculation_check(qg, prev, units, spec)
        expected = retrieval_ref.speculation_check(qg, prev, units, spec, 40)
        assert torch.equal(got[0], expected[0]), (k, k2)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
        torch.testing.assert_close(got[2], expected[2], rtol=1e-6, atol=1e-6)
        assert got[2][1, 2] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("out_features,in_features,bias,lead", [(37, 50, True, (1, 1)), (64, 576, False, (1,)),
                                                                (3, 16, True, ()), (1536, 64, False, (1, 1))])
def test_native_linear_equals_torchs(out_features, in_features, bias, lead):
    """Rows not a multiple of 4, columns not a multiple of 16, with and without bias, any leading ones."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    g = gen(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(*lead, in_features, generator=g)
    assert cpu_native.supports_linear(x, w, b)
    out = cpu_native.linear(x, w, b)
    assert out.shape == (*lead, out_features)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert not cpu_native.supports_linear(torch.randn(2, in_features), w, b)  # two rows: torch's matrix product
    assert not cpu_native.supports_linear(x.bfloat16(), w.bfloat16(), None)
    assert not cpu_native.supports_linear(x, w.t().contiguous().t(), b)  # a transposed weight
