import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Triton kernels are tested on the CPU through Triton's interpreter, which must be chosen before triton is first
# imported; on a CUDA machine (experiments/gpu_check.sh) they run compiled on the GPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tiny models' device: cpu here and in CI; experiments/gpu_check.sh runs the contract suite's end-to-end
# tests with KVCOMP_TEST_DEVICE=cuda (the compressors' CUDA paths and the Triton kernels inside a model).
TEST_DEVICE = os.environ.get("KVCOMP_TEST_DEVICE", "cpu")
# OMP_NUM_THREADS wins when set: on a shared, loaded machine two threads per tiny op thrash (~6x slower).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the random 2-layer Llama; kvcomp installs its attention on it."""
    from kvcomp import load_model

    return load_model("tiny", device=TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny64():
    """The tiny model in float64: batched and single runs then differ by ~1e-15, so a test comparing them
    checks the logic (padding, per-row budgets) rather than float32 rounding on near-tied scores."""
    from kvcomp import load_model

    return load_model("tiny", dtype=torch.float64, device=TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny_reference():
    """An identical tiny model left on transformers' own sdpa attention: the 'without kvcomp' reference."""
    from kvcomp import load_model

    model, tokenizer = load_model("tiny", device=TEST_DEVICE)
    model.set_attn_implementation("sdpa")
    return model, tokenizer


@pytest.fixture(scope="session")
def embedded():
    from kvcomp import load_model

    return load_model()


@pytest.fixture(scope="session")
def embedded_reference(embedded):
    """A second instance of the embedded model on plain sdpa (shares no attention setting with `embedded`)."""
    from kvcomp import load_model

    model, tokenizer = load_model()
    model.set_attn_implementation("sdpa")
    return model, tokenizer
