"""The package's import surface: public names load on first use, and the kernels need torch alone."""

import subprocess
import sys

import pytest

import kvcomp


def test_every_public_name_resolves_to_its_module_object():
    from kvcomp import cache, compressor, registry

    assert kvcomp.CompressedCache is cache.CompressedCache
    assert kvcomp.Compressor is compressor.Compressor and kvcomp.create is registry.create
    for name in kvcomp.__all__:
        assert getattr(kvcomp, name) is not None, name
    assert set(kvcomp.__all__) <= set(dir(kvcomp))


def test_a_submodule_is_an_attribute_and_a_wrong_name_is_an_attribute_error():
    assert kvcomp.tiers.Prefetcher.__module__ == "kvcomp.tiers"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        kvcomp.no_such_name  # noqa: B018


def test_the_kernels_and_the_attention_rule_import_without_transformers():
    """A GPU image with another transformers (or none) still runs experiments/gpu_check.sh's kernel tests."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"  # any import of transformers now fails
        "import kvcomp, kvcomp.ops, kvcomp.compressor, kvcomp.files\n"
        "from kvcomp.kernels import cpu_native, quant_cpu, quant_ref, retrieval_ref, sparse_ref\n"
        "cpu_native.library_path()\n"
        "assert 'transformers' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
