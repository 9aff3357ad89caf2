"""Faults that lose data or leave it behind (issue 18, item 2) and the small things of item 5.

Every test here runs real processes against real files: a small tmpfs for the full offload disk (the CI runs
as root; where mounting is impossible the free-space probe is patched instead, in the child process too),
SIGTERM and SIGKILL sent to a child, two processes writing one run directory, symbolic links planted in an
output directory, corrupted calibration artifacts and a planted kernel library.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def python(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def spawn(code: str, *args: str) -> subprocess.Popen:
    """A child that prints one line when ready (read it with ``ready``)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ready(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().strip()
    assert line, proc.stderr.read()
    return line


# -- a small filesystem ----------------------------------------------------------------------------------------
@dataclass
class SmallFS:
    path: Path
    size: int
    real: bool  # a mounted tmpfs; otherwise a directory with the free-space probe patched

    @property
    def prelude(self) -> str:
        """Code that a child process runs first so it sees this filesystem's free space."""
        if self.real:
            return ""
        return (f"import kvcomp.tiers as _t, os as _os\n"
                f"_t._free_bytes = lambda p: {self.size} - sum(_os.path.getsize(_os.path.join(d, f)) "
                f"for d, _, fs in _os.walk({str(self.path)!r}) for f in fs)\n")

    def entries(self) -> list[str]:
        return sorted(os.listdir(self.path))


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(bytes)``: a tmpfs of that size (mount needs root), else a patched-probe directory."""
    mounted = []

    def make(size: int) -> SmallFS:
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            mounted.append(path)
            return SmallFS(path, size, True)
        return SmallFS(path, size, False)

    yield make
    for path in mounted:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_the_small_filesystem_is_a_real_tmpfs_where_we_are_root(small_fs):
    fs = small_fs(64 * 1024)
    assert fs.real or os.geteuid() != 0  # root (the CI) mounts; others fall back to the probe
    if fs.real:
        st = os.statvfs(fs.path)
        assert st.f_blocks * st.f_frsize == 64 * 1024


# -- item 2: a full offload disk -------------------------------------------------------------------------------
def test_a_disk_tier_on_a_full_filesystem_raises_tier_full_and_removes_its_files(small_fs):
    fs = small_fs(256 * 1024)
    proc = python(fs.prelude + """
        import os, sys, torch
        from kvcomp.tiers import DiskTier, TierFull
        root = sys.argv[1]
        tier = DiskTier(directory=root)
        k = torch.ones(1, 2, 2048, 16)  # 2048 tokens (64 blocks): 2 * 2 * 2048 * 16 * 4 = 524288 bytes of K and V
        try:
            tier.write(0, k, k)
        except TierFull as err:
            print("full", err.needed, err.directory == tier.path, tier.closed, os.listdir(root))
            print("message", err)
        grower = DiskTier(directory=root)
        grower.write(0, k[:, :, :100], k[:, :, :100])
        try:
            for step in range(10000):
                grower.append(0, k[:, :, :1], k[:, :, :1])
        except TierFull as err:
            print("grown", step > 200, grower.closed, os.listdir(root))
    """, str(fs.path))
    assert proc.returncode == 0, proc.stderr[-3000:]  # before the fix: -7 (SIGBUS), files left
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["full"] == "524288 True True []"
    assert "needs 524,288 more bytes in " + str(fs.path) in lines["message"] and "free" in lines["message"]
    assert "offload_dir" in lines["message"] and "tier='host'" in lines["message"]
    assert lines["grown"] == "True True []"
    assert fs.entries() == []


def _prompt_tokens(tokens: int) -> str:
    return "The grass is green. " * (tokens // 6)  # about 6 tokens a sentence in the embedded tokenizer


@pytest.mark.parametrize("method", ["freekv", "specache", "lossless"])
def test_offload_on_a_full_disk_ends_in_one_clear_error_and_leaves_nothing(small_fs, method):
    # The tiny model stores 2 KV heads x 16 dims x 4 bytes x (K, V) = 256 bytes per token and layer: 700 tokens fit
    # one layer of a 256 KiB filesystem, not two.
    fs = small_fs(256 * 1024)
    context = _prompt_tokens(700)
    if method == "lossless":
        proc = python(fs.prelude + """
            import sys
            import kvcomp
            from compressors.snapkv import SnapKV
            model, tokenizer = kvcomp.load_model("tiny")
            config = kvcomp.Lossless(tier="disk", tier_options={"directory": sys.argv[1]})
            try:
                kvcomp.generate(model, tokenizer, sys.argv[2], "\\nQ?", compressor=SnapKV(compression_ratio=0.5),
                                lossless=config, max_new_tokens=4)
            except kvcomp.tiers.TierFull as err:
                sys.exit(f"kvcomp: {err}")
        """, str(fs.path), context)
        assert proc.returncode == 1, proc.stderr[-3000:]
    else:
        proc = python(fs.prelude + """
            import sys
            from experiments.cli import main
            sys.exit(main(sys.argv[1:]))
        """, "generate", "--model", "tiny", "--compressor", method, "--param", f"offload_dir={fs.path}",
                      "--context", context, "--max-new-tokens", "4")
        assert proc.returncode == 2, proc.stderr[-3000:]  # before the fix: -7 (SIGBUS), no message
    assert "Offload disk full" in proc.stderr and str(fs.path) in proc.stderr and "Traceback" not in proc.stderr
    assert fs.entries() == []  # the other layers' directories went at exit


# -- item 2: SIGTERM, SIGKILL --------------------------------------------------------------------------------
HOLD_A_TIER = """
    import signal, sys, time, torch
    from kvcomp.tiers import DiskTier
    if len(sys.argv) > 2:  # a handler of the application's own, installed before kvcomp's
        def own(signum, frame):
            open(sys.argv[2], "w").write("own handler ran")
            sys.exit(7)
        signal.signal(signal.SIGTERM, own)
    tier = DiskTier(directory=sys.argv[1])
    tier.write(0, torch.ones(1, 2, 64, 16), torch.ones(1, 2, 64, 16))
    print(tier.path, flush=True)
    time.sleep(120)
"""


def test_sigterm_removes_the_tier_files_and_ends_with_the_sigterm_status(tmp_path):
    child = spawn(HOLD_A_TIER, str(tmp_path))
    path = Path(ready(child))
    assert (path / "layer0.kv").is_file()
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM  # killed by SIGTERM, as without kvcomp (143 in a shell)
    assert not path.exists() and os.listdir(tmp_path) == []  # before the fix: the plaintext KV stayed


def test_sigterm_cleanup_chains_the_applications_own_handler(tmp_path):
    marker = tmp_path / "marker"
    root = tmp_path / "root"
    child = spawn(HOLD_A_TIER, str(root), str(marker))
    path = Path(ready(child))
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 7
    assert marker.read_text() == "own handler ran" and not path.exists()


STORE_BENCH_PAUSED = """
    import sys, time
    import kvcomp.redis_store, kvcomp.shared_prefill
    from experiments import store_bench
    servers = []
    class Recorded(kvcomp.redis_store.LocalServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            servers.append(self)
    kvcomp.redis_store.LocalServer = Recorded
    def paused(*args, **kwargs):  # the first sample's prefill: its stores are open, its Redis is running
        print(servers[0].proc.pid, flush=True)
        time.sleep(120)
    kvcomp.shared_prefill.prefill = paused
    store_bench.main(["--model", "tiny", "--lengths", "512", "--samples", "1", "--tasks", "ruler/niah_single_1",
                      "--methods", "none", "--drafters", "--out", sys.argv[1]])
"""


def test_sigterm_stops_the_store_benchmarks_redis_and_removes_its_stored_kv(tmp_path):
    out = tmp_path / "bench"
    child = spawn(STORE_BENCH_PAUSED, str(out))
    redis_pid = int(ready(child))
    assert len(list(out.glob("store-*"))) == 1 and _alive(redis_pid)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM
    # before the fix: the store directory (plaintext K/V) stayed, and the redis-server went on listening
    assert list(out.glob("store-*")) == [] and not _alive(redis_pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (nobody has reaped it yet)


def test_what_sigkill_leaves_is_swept_at_the_next_start_and_live_tiers_are_kept(tmp_path):
    from kvcomp.tiers import DiskTier

    killed, alive = spawn(HOLD_A_TIER, str(tmp_path)), spawn(HOLD_A_TIER, str(tmp_path))
    try:
        killed_path, alive_path = Path(ready(killed)), Path(ready(alive))
        killed.kill()
        assert killed.wait(timeout=60) == -signal.SIGKILL
        assert killed_path.is_dir()  # nothing can run on SIGKILL: the next start removes it
        unknown = tmp_path / "kvcomp-tier-oldformat"  # no pid, no lock: cannot be judged, left alone
        unknown.mkdir()
        with pytest.warns(UserWarning, match=f"removed 1 offload directory .*{killed_path.name}"):
            tier = DiskTier(directory=tmp_path)
        assert not killed_path.exists() and alive_path.is_dir() and unknown.is_dir()
        assert (alive_path / "layer0.kv").is_file()
        tier.close()
    finally:
        alive.kill()
        alive.wait(timeout=60)


# -- item 2: one process per run directory ---------------------------------------------------------------------
DEMO = ["demo", "--model", "tiny", "--samples", "1", "--length", "256", "--compressors", "snapkv", "--ratios", "0.5",
        "--mode", "aware", "--max-new-tokens", "2"]


def _records(root: Path) -> list[str]:
    return sorted(line for p in root.rglob("results.jsonl") for line in p.read_text().splitlines())


def test_a_second_process_on_a_held_run_directory_is_refused_naming_the_holder(tmp_path):
    from kvcomp.files import lock_run_dir

    out = tmp_path / "demo"
    lock = lock_run_dir(out, "the test")
    try:
        proc = python("import sys; from experiments.cli import main; sys.exit(main(sys.argv[1:]))",
                      *DEMO, "--out", str(out))
        assert proc.returncode == 2, proc.stderr[-3000:]  # before the fix: 0, and both write every record
        assert f"kvcomp: {out} is being written by another kvcomp process (pid {os.getpid()} on " in proc.stderr
        assert "pytest" in proc.stderr and "Traceback" not in proc.stderr and _records(out) == []
        run = python("import sys; from experiments.run import main; main()", "model=tiny", "task.length=256",
                     "task.num_samples=1", "fidelity=false", f"hydra.run.dir={out}")
        assert run.returncode != 0 and f"pid {os.getpid()}" in run.stderr and "Traceback" not in run.stderr
        assert not (out / "config.yaml").exists()
    finally:
        lock.release()
    proc = python("import sys; from experiments.cli import main; sys.exit(main(sys.argv[1:]))", *DEMO, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_records(out)) == 2  # none and snapkv-0.5, one sample each: nothing duplicated


def test_the_api_refuses_a_directory_another_process_holds_and_re_enters_its_own(tiny, tmp_path):
    from eval.runner import load_samples, run, run_grid
    from kvcomp.files import RunDirBusy, lock_run_dir

    model, tokenizer = tiny
    task = load_samples("ruler/niah_single_1", tokenizer, length=256, num_samples=1, tokens_to_generate=2)
    holder = spawn("""
        import sys, time
        from kvcomp.files import lock_run_dir
        lock = lock_run_dir(sys.argv[1], "the child")
        print("held", flush=True)
        time.sleep(120)
    """, str(tmp_path / "grid"))
    try:
        ready(holder)
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid} on .*-c {tmp_path / 'grid'}"):
            run_grid(model, tokenizer, task, {"none": None}, query_aware=False, out_dir=tmp_path / "grid")
        with pytest.raises(RunDirBusy, match=f"pid {holder.pid}"):
            run(model, tokenizer, task, None, query_aware=False, out_path=tmp_path / "grid" / "results.jsonl")
    finally:
        holder.kill()
        holder.wait(timeout=60)
    # This process may take the lock it already holds (experiments.run holds its run directory around run()).
    with lock_run_dir(tmp_path / "mine"):
        records = list(run(model, tokenizer, task, None, query_aware=False, out_path=tmp_path / "mine" / "r.jsonl"))
    assert len(records) == 1
    with lock_run_dir(tmp_path / "grid"):  # the holder is dead: its lock went with it
        pass


# -- item 2: output files that are symbolic links --------------------------------------------------------------
VICTIM = b'{"id": "keep me"}\n{"partial'  # an interrupted last line: the resume repair would truncate it


@pytest.mark.parametrize("where", ["run-results", "run-reference", "grid-results", "grid-summary", "grid-dir",
                                   "grid-reference", "demo-csv", "experiments-config", "experiments-summary"])
def test_an_output_that_is_a_symlink_is_refused_and_its_target_untouched(tiny, tmp_path, where):
    from eval.runner import load_samples, run, run_grid
    from experiments.demo import run_demo

    model, tokenizer = tiny
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.jsonl"
    victim.write_bytes(VICTIM)
    out = tmp_path / "out"
    task = load_samples("ruler/niah_single_1", tokenizer, length=256, num_samples=1, tokens_to_generate=2)
    link = {"run-results": out / "results.jsonl", "run-reference": out / "reference.jsonl",
            "grid-results": out / "none" / "results.jsonl", "grid-summary": out / "none" / "summary.json",
            "grid-dir": out / "none", "grid-reference": out / "reference.jsonl",
            "demo-csv": out / "summary-L256.csv", "experiments-config": out / "config.yaml",
            "experiments-summary": out / "summary.json"}[where]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside if where == "grid-dir" else victim)
    error = None
    try:
        if where.startswith("run"):
            list(run(model, tokenizer, task, None, query_aware=False, out_path=out / "results.jsonl"))
        elif where.startswith("grid"):
            run_grid(model, tokenizer, task, {"none": None}, query_aware=False, out_dir=out)
        elif where == "demo-csv":
            run_demo(model, tokenizer, samples=1, length=256, compressors=(), modes=("aware",), out_dir=out,
                     max_new_tokens=2, progress=False)
        else:
            from experiments.run import evaluate
            from tests.test_experiments import compose

            cfg = compose(["model=tiny", "task.length=256", "task.num_samples=1", "task.max_new_tokens=2",
                           "fidelity=false"])
            evaluate(cfg, out)
    except Exception as err:  # noqa: BLE001 (checked below, after the target)
        error = err
    assert victim.read_bytes() == VICTIM and os.listdir(outside) == ["victim.jsonl"]  # before the fix: truncated
    assert isinstance(error, OSError) and str(error).startswith(f"{link} is a symbolic link; kvcomp does not write")


# -- item 2: corrupted KVTC artifacts ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kvtc_artifact(tiny, tmp_path_factory) -> Path:
    from kvcomp import kvtc_calibration as calibration

    model, tokenizer = tiny
    return calibration.calibrate(model, tokenizer, tmp_path_factory.mktemp("kvtc") / "tiny.safetensors",
                                 tokens=600, seq_len=300)


def _flip_byte(path: Path, tensor: str, at: int = 5) -> None:
    """Flip one byte of ``tensor``'s data in a safetensors file (8-byte header length, JSON header, data)."""
    import json as _json

    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, _ = _json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    raw[8 + n + begin + at] ^= 0x40
    path.write_bytes(bytes(raw))


def _rewrite(src: Path, dst: Path, change) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    change(tensors, meta)
    save_file(tensors, str(dst), metadata=meta)


@pytest.mark.parametrize("damage", ["flip-basis", "flip-step", "nan-basis", "missing-basis", "truncated",
                                    "no-digest-v3", "bad-shape"])
def test_a_damaged_kvtc_artifact_is_refused_naming_what_is_wrong(tiny, kvtc_artifact, tmp_path, damage):
    import torch

    from kvcomp import kvtc_calibration as calibration
    from kvcomp.compressor import CompressorError

    model, _ = tiny
    path = tmp_path / "damaged.safetensors"
    shutil.copy(kvtc_artifact, path)
    if damage.startswith("flip"):
        _flip_byte(path, damage.split("-")[1])
        expected = "is corrupted: its tensors do not match the sha256 recorded"
    elif damage == "nan-basis":
        def nan(tensors, meta):  # written with a consistent digest: only the finiteness check can tell
            tensors["basis"][0, 0, 0, 0, 0] = float("nan")
            meta["tensors_sha256"] = calibration.tensors_digest(tensors)
        _rewrite(kvtc_artifact, path, nan)
        expected = "has 1 non-finite value (NaN or inf) in tensor 'basis'"
    elif damage == "missing-basis":
        _rewrite(kvtc_artifact, path, lambda tensors, meta: tensors.pop("basis"))
        expected = "lacks the tensor 'basis'"
    elif damage == "truncated":
        path.write_bytes(kvtc_artifact.read_bytes()[:-1000])
        expected = "Cannot read the KVTC artifact"
    elif damage == "no-digest-v3":
        _rewrite(kvtc_artifact, path, lambda tensors, meta: meta.pop("tensors_sha256"))
        expected = "has lost the digest"
    else:
        _rewrite(kvtc_artifact, path, lambda tensors, meta: tensors.update(mean=torch.zeros(3)))
        expected = "tensor 'mean' has shape (3,)"
    with pytest.raises(CompressorError, match=re.escape(expected)) as err:
        calibration.load_artifact(path, model)
    assert str(path) in str(err.value) and "Recalibrate with: kvcomp calibrate kvtc" in str(err.value)
    shutil.copy(kvtc_artifact, path)
    assert calibration.load_artifact(path, model).basis.shape[-1] == 16  # the intact copy still loads


def test_a_version_2_artifact_without_a_digest_still_loads_with_a_warning(tiny, kvtc_artifact, tmp_path):
    from compressors.kvtc import KVTC
    from kvcomp import generate
    from kvcomp import kvtc_calibration as calibration

    model, tokenizer = tiny
    old = tmp_path / "v2.safetensors"

    def as_v2(tensors, meta):
        meta.pop("tensors_sha256")
        meta["version"] = "2"

    _rewrite(kvtc_artifact, old, as_v2)
    assert not calibration.is_current(old)
    with pytest.warns(UserWarning, match="carries no digest .*Recalibrate with: kvcomp calibrate kvtc"):
        result = generate(model, tokenizer, "The grass is green. " * 40, "\nQ?", max_new_tokens=3,
                          compressor=KVTC(compression_factor=4, artifact=str(old), window=16))
    assert result.memory_factor > 1.5
    assert calibration.is_current(kvtc_artifact)


# -- item 5: the demo table describes the samples asked for ----------------------------------------------------
def test_demo_with_fewer_samples_than_the_directory_holds_reports_those_samples(capsys, tmp_path):
    import csv

    from experiments.cli import main

    args = DEMO[:3] + DEMO[5:] + ["--out", str(tmp_path)]  # DEMO without its --samples
    assert main(args + ["--samples", "3"]) == 0
    capsys.readouterr()
    assert main(args + ["--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 samples" in out
    rows = list(csv.DictReader(open(tmp_path / "summary-L256.csv")))
    assert [r["n"] for r in rows] == ["2", "2"]  # before the fix: 3, the whole directory, under a "2 samples" title
    assert len(_records(tmp_path)) == 6  # the third sample's records stay on disk
    summary = (tmp_path / "L256" / "aware" / "snapkv-0.5" / "summary.json").read_text()
    assert '"n": 2' in summary


# -- item 5: a cached kernel library is loaded only when it is ours and writable by no one else -----------------
@pytest.mark.parametrize("plant", ["group-writable", "other-owner", "symlink", "shared-dir", "open-dir"])
def test_a_planted_or_tampered_kernel_library_is_rebuilt_not_loaded(tmp_path, monkeypatch, plant):
    import stat

    from kvcomp.kernels import cpu_native

    if not shutil.which(os.environ.get("CC", "cc")):
        pytest.fail("the native kernel tests need a C compiler (cc)")
    if plant in ("other-owner", "shared-dir") and os.geteuid() != 0:
        pytest.skip("planting another user's file needs root (the CI runs as root)")
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVCOMP_NATIVE", "1")
    monkeypatch.setattr(cpu_native, "_lib", None)
    target = cpu_native.library_path()
    target.parent.mkdir(parents=True)
    planted = b"\x7fELF not a library: loading it would run whatever it holds"
    if plant == "symlink":
        (tmp_path / "elsewhere.so").write_bytes(planted)
        target.symlink_to(tmp_path / "elsewhere.so")
    elif plant == "open-dir":  # our own directory, writable by anyone: made private, then used
        os.chmod(target.parent, 0o777)
        planted = None
    else:
        target.write_bytes(planted)
        os.chmod(target, 0o666 if plant == "group-writable" else 0o755)
    if plant == "other-owner":
        os.chown(target, 65534, 65534)  # nobody (the CI runs as root; as another user chown would fail)
    if plant == "shared-dir":
        os.chown(target.parent, 65534, 65534)
    with pytest.warns(UserWarning, match="Rebuilding it|private temporary directory|made it private"):
        lib = cpu_native.load()
    assert lib is not None and hasattr(lib, "quant_attention_f32")  # before the fix: the planted file, unloadable
    if plant == "shared-dir":
        assert target.read_bytes() == planted  # not used, not replaced: the directory is not ours
    else:
        st = os.lstat(target)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
        assert target.read_bytes() != planted and not os.stat(target.parent).st_mode & 0o022
        assert (tmp_path / "elsewhere.so").exists() or plant != "symlink"
