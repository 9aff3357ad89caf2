"""kvcomp.tiers: exact round trips in every tier, crop, disk cleanup, and a prefetcher that never returns stale data."""

import gc
import os
import threading

import pytest
import torch

from kvcomp import tiers
from kvcomp.tiers import DiskTier, FetchRequest, HostTier, Prefetcher, RamTier, Tier, make_tier

B, H, D = 2, 3, 8


def kv(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, n, D, generator=g).to(dtype), torch.randn(B, H, n, D, generator=g).to(dtype))


@pytest.fixture(params=["ram", "host", "disk"])
def tier(request, tmp_path):
    kwargs = {"directory": tmp_path} if request.param == "disk" else {}
    t = make_tier(request.param, **kwargs)
    yield t
    t.close()


@pytest.mark.parametrize("native", ["1", "0"], ids=["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_append_read_gather_round_trip_exactly(tier, dtype, native, monkeypatch):
    monkeypatch.setenv("KVCOMP_NATIVE", native)  # the C kernel's writes and gathers, and torch's
    k0, v0 = kv(40, 0, dtype)
    tier.write(0, k0, v0)
    blocks = [(k0, v0)]
    for step in range(300):  # crosses at least one growth of the storage
        k1, v1 = kv(1 + step % 3, step + 1, dtype)
        tier.append(0, k1, v1)
        blocks.append((k1, v1))
    k1, v1 = kv(700, 999, dtype)  # starts inside a block and spans two write chunks of whole blocks
    tier.append(0, k1, v1)
    blocks.append((k1, v1))
    keys = torch.cat([b[0] for b in blocks], dim=2)
    values = torch.cat([b[1] for b in blocks], dim=2)
    assert tier.length(0) == keys.shape[2]
    k, v = tier.read(0)
    assert k.dtype == dtype and torch.equal(k, keys) and torch.equal(v, values)
    for start, stop in ((17, 123), (32, 64), (33, 34), (600, 1200)):
        k, v = tier.read(0, start, stop)
        assert torch.equal(k, keys[:, :, start:stop]) and torch.equal(v, values[:, :, start:stop])
    index = torch.randint(0, keys.shape[2], (B, H, 11), generator=torch.Generator().manual_seed(9))
    k, v = tier.gather(0, index)
    assert torch.equal(k, keys.gather(2, index[..., None].expand(-1, -1, -1, D)))
    assert torch.equal(v, values.gather(2, index[..., None].expand(-1, -1, -1, D)))


def test_gather_skips_negative_indices_and_counts_bytes(tier):
    k0, v0 = kv(50, 1)
    tier.write(3, k0, v0)
    index = torch.arange(6).view(1, 1, 6).repeat(B, H, 1)
    index[0, 1, 2:] = -1
    before = tier.bytes_read
    k, v = tier.gather(3, index)
    assert tier.bytes_read - before == (B * H * 6 - 4) * 2 * D * 4
    assert torch.equal(k[0, 1, 2:], torch.zeros(4, D)) and torch.equal(v[0, 1, :2], v0[0, 1, :2])
    assert torch.equal(k[1, 2], k0[1, 2, :6])
    with pytest.raises(IndexError):
        tier.gather(3, torch.full((B, H, 1), 50))
    k, v = tier.gather(3, torch.full((B, H, 3), -1))  # nothing wanted: zeros, no bytes
    k_none, _ = tier.gather(3, torch.zeros(B, H, 0, dtype=torch.long))  # an empty selection
    assert tier.bytes_read - before == (B * H * 6 - 4) * 2 * D * 4
    assert torch.equal(k, torch.zeros(B, H, 3, D)) and torch.equal(v, torch.zeros(B, H, 3, D))
    assert k_none.shape == (B, H, 0, D)


def test_returned_tensors_are_copies_not_views(tier):
    k0, v0 = kv(10, 2)
    tier.write(0, k0, v0)
    k, _ = tier.read(0)
    tier.write(0, *kv(10, 3))
    assert torch.equal(k, k0)


def test_crop_keeps_prefix_and_appends_after_it(tier):
    k0, v0 = kv(30, 4)
    tier.write(1, k0, v0)
    version = tier.version(1)
    tier.crop(1, 21)
    assert tier.length(1) == 21 and tier.version(1) != version
    tier.crop(1, -1)
    assert tier.length(1) == 20
    k1, v1 = kv(5, 5)
    tier.append(1, k1, v1)
    k, v = tier.read(1)
    assert torch.equal(k, torch.cat([k0[:, :, :20], k1], 2)) and torch.equal(v, torch.cat([v0[:, :, :20], v1], 2))
    tier.crop(1, 100)  # longer than stored: nothing happens
    assert tier.length(1) == 25


def test_layers_are_independent_and_nbytes_is_allocated_capacity():
    tier = RamTier()
    block = tiers.BLOCK  # storage is allocated a block of tokens at a time
    tier.write(0, *kv(10, 6))
    tier.write(5, *kv(block + 4, 7))
    assert tier.layers == [0, 5]
    assert tier.nbytes() == (block + 2 * block) * B * H * 2 * D * 4
    tier.append(5, *kv(block - 4, 8))  # fills the second block of layer 5: nothing allocated
    assert tier.nbytes() == 3 * block * B * H * 2 * D * 4
    tier.append(5, *kv(1, 8))  # grows by at least 256 tokens
    assert tier.nbytes() == (block + 2 * block + 256) * B * H * 2 * D * 4
    tier.free(0)
    assert tier.layers == [5]
    assert isinstance(tier, Tier) and tier.kind == "device" and HostTier.kind == "host" and DiskTier.kind == "disk"


def test_disk_tier_files_are_removed_on_free_close_and_context_exit(tmp_path):
    tier = DiskTier(directory=tmp_path)
    tier.write(0, *kv(8, 0))
    tier.write(1, *kv(8, 1))
    assert sorted(os.listdir(tier.path)) == ["layer0.kv", "layer1.kv", "owner.lock"]
    assert os.path.getsize(tier.file(0)) == tiers.BLOCK * B * H * 2 * D * 4 == tier.nbytes() // 2  # one block
    tier.free(0)
    assert sorted(os.listdir(tier.path)) == ["layer1.kv", "owner.lock"]
    tier.close()
    assert os.listdir(tmp_path) == []
    with DiskTier(directory=tmp_path) as t:
        t.write(0, *kv(8, 0))
        assert len(os.listdir(tmp_path)) == 1
    assert os.listdir(tmp_path) == []


def open_files_under(path) -> list[str]:
    """The files under ``path`` this process holds open (a removed one ends in " (deleted)"), one entry per
    descriptor (a mapping holds one of its own)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the directory listing's own descriptor, closed by now
            continue
        if target.startswith(str(path)):
            names.append(os.path.basename(target))
    return sorted(names)


@pytest.mark.parametrize("end", ["free", "close", "garbage collection"])
def test_disk_tier_closes_its_layer_files_at_every_end(tmp_path, end):
    """A layer's file stays open while it is stored (the gathers read and the appends write it) and is closed
    when it goes: a removed file still open would keep its disk space."""
    tier = DiskTier(directory=tmp_path)
    for layer in range(3):
        tier.write(layer, *kv(40, layer))
        tier.append(layer, *kv(300, layer))  # grows the file: the same descriptor
    tier.write(1, *kv(8, 9))  # replaces layer 1: its old file closed, a new one opened
    assert not any(name.endswith("(deleted)") for name in open_files_under(tmp_path))
    assert set(open_files_under(tmp_path)) == {"layer0.kv", "layer1.kv", "layer2.kv", "owner.lock"}
    if end == "free":
        for layer in range(3):
            tier.free(layer)
        assert open_files_under(tmp_path) == ["owner.lock"]
    elif end == "close":
        tier.close()
    else:
        del tier
        gc.collect()
    if end != "free":
        assert open_files_under(tmp_path) == [] and os.listdir(tmp_path) == []


def resident_kib(path) -> int:
    """This process's resident KiB of the mappings of file ``path`` (Linux's /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.parametrize("native", ["1", "0"], ids=["kernel", "torch"])
def test_disk_tier_accesses_leave_none_of_the_file_resident(tmp_path, native, monkeypatch):
    # 20,001 tokens of 384 bytes (7.3 MiB): rows straddle pages, and an append or a read touches one part of
    # the file, whose neighbouring pages a read fault may map as well.
    monkeypatch.setenv("KVCOMP_NATIVE", native)  # pread / pwrite, or through the mapping then madvise
    tier = DiskTier(directory=tmp_path)
    k, v = kv(20001, 0)
    tier.write(0, k, v)
    assert resident_kib(tier.file(0)) == 0
    for n in (1, 1, 3, 40):
        tier.append(0, *kv(n, n))
        assert resident_kib(tier.file(0)) == 0
    got = tier.read(0, 1000, 1011)
    assert torch.equal(got[0], k[:, :, 1000:1011]) and resident_kib(tier.file(0)) == 0
    tier.gather(0, torch.randint(0, 20001, (B, H, 50)))
    assert resident_kib(tier.file(0)) == 0
    tier.close()


@pytest.mark.parametrize("kind", ["ram", "disk"])
def test_gathers_through_the_kernel_equal_torchs(tmp_path, monkeypatch, kind):
    """The C kernel's gather (the disk tier's with pread, nothing mapped; a memory tier's with copies) gives
    the same bytes as torch's (KVCOMP_NATIVE=0, through the mapping on disk), for runs of pages, scattered
    tokens, repeats, descending order, spans longer than one read, and -1 slots."""
    from kvcomp.kernels import cpu_native

    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    tier = make_tier(kind, **({"directory": tmp_path} if kind == "disk" else {}))
    k, v = kv(9000, 3)
    tier.write(0, k, v)
    g = torch.Generator().manual_seed(4)
    pages = torch.randint(0, 280, (B, H, 6), generator=g).sort().values
    cases = {
        "pages": (pages.unsqueeze(-1) * 32 + torch.arange(32)).flatten(2),
        "scattered": torch.randint(0, 9000, (B, H, 300), generator=g),
        "repeats": torch.full((B, H, 5), 17),
        "descending": torch.arange(8999, 8000, -7).expand(B, H, -1),
        "long span": torch.arange(0, 9000).expand(B, H, -1),  # one row run longer than READ_SPAN
        "with -1": torch.randint(-1, 9000, (B, H, 64), generator=g),
    }
    reads = []
    native = cpu_native.gather_tokens
    monkeypatch.setattr(cpu_native, "gather_tokens", lambda *a: reads.append(native(*a)) or reads[-1])
    for name, index in cases.items():
        got = tier.gather(0, index)
        with monkeypatch.context() as m:
            m.setenv("KVCOMP_NATIVE", "0")
            through_torch = tier.gather(0, index)
        expected = k.gather(2, index.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, D))
        expected = expected.masked_fill(index.unsqueeze(-1) < 0, 0)
        assert torch.equal(got[0], through_torch[0]) and torch.equal(got[1], through_torch[1]), name
        assert torch.equal(got[0], expected), name
    # Each case went through the kernel once (the rows it read) and was declined once (None).
    assert reads == [x for index in cases.values() for x in (int((index >= 0).sum()), None)]
    if kind == "disk":
        assert resident_kib(tier.file(0)) == 0
    tier.close()


def test_disk_tier_read_past_the_file_or_of_a_bad_descriptor_is_an_error(tmp_path):
    from kvcomp.kernels import cpu_native

    if cpu_native.load() is None:
        pytest.skip("no C compiler")
    tier = DiskTier(directory=tmp_path)
    tier.write(0, *kv(64, 5))
    out = torch.empty(1, 1, 1, 2, D)
    fd = os.open(tier.file(0), os.O_RDONLY)
    try:
        rows = os.fstat(fd).st_size // (2 * D * 4)  # one head: token t is row t
        with pytest.raises(OSError, match="Input/output error"):  # a short read
            cpu_native.gather_tokens(fd, None, torch.tensor([[[rows]]]), rows + 1, tiers.BLOCK, out)
        with pytest.raises(IndexError, match="beyond the 64 stored"):
            cpu_native.gather_tokens(fd, None, torch.tensor([[[64]]]), 64, tiers.BLOCK, out)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="Bad file descriptor"):
        cpu_native.gather_tokens(fd, None, torch.tensor([[[0]]]), 64, tiers.BLOCK, out)
    with pytest.raises(OSError, match="Bad file descriptor"):
        cpu_native.pwrite_tokens(fd, out[..., 0, :], out[..., 1, :], 0, tiers.BLOCK)
    tier.close()


def test_disk_tier_is_removed_when_dropped_after_an_exception(tmp_path):
    def crash():
        tier = DiskTier(directory=tmp_path)
        tier.write(0, *kv(8, 0))
        assert len(os.listdir(tmp_path)) == 1
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        crash()
    gc.collect()
    assert os.listdir(tmp_path) == []

    with pytest.raises(RuntimeError, match="boom"), DiskTier(directory=tmp_path) as tier:
        tier.write(0, *kv(8, 0))
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overlap", [True, False])
def test_prefetcher_returns_the_request_of_that_step(overlap):
    tier = RamTier()
    k0, v0 = kv(64, 0)
    tier.write(0, k0, v0)
    pf = Prefetcher(overlap=overlap)
    index = torch.randint(0, 64, (B, H, 5), generator=torch.Generator().manual_seed(1))
    pf.submit(7, FetchRequest(tier, 0, index))
    result = pf.wait(7)
    assert result is not None and result.request.index is index
    assert torch.equal(result.keys, k0.gather(2, index[..., None].expand(-1, -1, -1, D)))
    assert result.nbytes == B * H * 5 * 2 * D * 4
    assert pf.stats.prefetches_used == 1 and pf.stats.per_step[7][0] == result.nbytes
    assert pf.wait(7) is None  # consumed


def test_prefetch_worker_computes_on_one_thread_and_leaves_the_callers_count(monkeypatch):
    # A worker with several intra-op threads starts a second OpenMP team, which slows every small operation
    # of the compute thread; the worker takes one thread without changing anyone else's count.
    monkeypatch.setattr(tiers, "_shared_worker", None)  # a worker started in this test, not an earlier one
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tier = RamTier()
        tier.write(0, *kv(64, 0))
        pf = Prefetcher()
        pf.submit(0, FetchRequest(tier, 0, torch.zeros(B, H, 3, dtype=torch.long)))
        assert pf.wait(0) is not None
        assert tiers._shared_worker.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2
        started_later = []
        thread = threading.Thread(target=lambda: started_later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert started_later == [2]  # the default for new threads is the caller's, not the worker's
    finally:
        tiers._shared_worker.shutdown()
        torch.set_num_threads(before)


def test_prefetcher_never_returns_stale_data():
    tier = RamTier()
    k0, v0 = kv(64, 0)
    tier.write(0, k0, v0)
    pf = Prefetcher()
    index = torch.zeros(B, H, 3, dtype=torch.long)
    # A submission for another step is dropped, not returned.
    pf.submit(1, FetchRequest(tier, 0, index))
    assert pf.wait(2) is None
    # A newer submission replaces an unconsumed one (double buffering: one filling, one in use).
    pf.submit(3, FetchRequest(tier, 0, index))
    pf.submit(4, FetchRequest(tier, 0, index + 1))
    assert pf.wait(3) is None
    # Rewritten or cropped after the submission: the data read may be stale, so it is dropped.
    pf.submit(5, FetchRequest(tier, 0, index + 2))
    tier.crop(0, 10)
    assert pf.wait(5) is None
    pf.submit(5, FetchRequest(tier, 0, index))
    tier.free(0)
    tier.write(0, *kv(64, 9))  # a new layer with the same index: the earlier request is still stale
    assert pf.wait(5) is None
    pf.submit(6, FetchRequest(tier, 0, index))
    new_k, _ = tier.read(0)
    result = pf.wait(6)
    assert torch.equal(result.keys, new_k[:, :, :1].expand(-1, -1, 3, -1))
    assert pf.stats.prefetches_dropped == 5 and pf.stats.prefetches_used == 1
    sync = pf.fetch(8, FetchRequest(tier, 0, index))
    assert pf.stats.sync_fetches == 1 and torch.equal(sync.keys, result.keys)


def test_prefetcher_streams_a_token_range(tmp_path):
    with DiskTier(directory=tmp_path) as tier:
        k0, v0 = kv(70, 3)
        tier.write(2, k0, v0)
        pf = Prefetcher()
        pf.submit(("verify", 2), FetchRequest(tier, 2, start=10))
        result = pf.wait(("verify", 2))
        assert torch.equal(result.keys, k0[:, :, 10:]) and torch.equal(result.values, v0[:, :, 10:])
        assert result.nbytes == B * H * 60 * 2 * D * 4 == pf.stats.bytes_moved
        tier.append(2, *kv(1, 4))
        assert torch.equal(pf.fetch(0, FetchRequest(tier, 2, start=5, stop=9)).keys, k0[:, :, 5:9])
