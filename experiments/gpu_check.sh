#!/usr/bin/env bash
# On a CUDA machine: the kernel tests on the GPU, the kernel benchmark (achieved GB/s of the fused quantized and
# sparse decode kernels and the retrieval scorers against the device's copy bandwidth, 8K-128K tokens), then the
# contract suite's end-to-end generation tests on CUDA. About 3-5 minutes; each stage has its own time limit so
# the whole script ends within 8.
#
#   bash experiments/gpu_check.sh            # results in runs/gpu_check/ (OUT=... to change)
#   WHEELS=.whl bash experiments/gpu_check.sh  # with the wheels of `make gpu-wheels` first on the path
#
# Needs python3 with a CUDA build of torch, triton, transformers and pytest (a GPU image usually has them);
# what is missing is installed with pip when a package index is reachable. kvcomp is used from this checkout
# (PYTHONPATH), not installed, so nothing is built.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
# WHEELS=dir: wheels to put first on the path (installed without dependencies into a temporary folder), for an
# image whose transformers is outside pyproject.toml's range; `make gpu-wheels` downloads them into .whl/.
if [ -n "${WHEELS:-}" ]; then
    SITE="$(mktemp -d)"
    trap 'rm -rf "$SITE"' EXIT
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
        && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" || echo "could not install the wheels in $WHEELS"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET      # compiled kernels on the GPU, not the interpreter
export KVCOMP_KERNELS=auto  # CUDA tensors -> Triton
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
for module in torch triton transformers pytest; do
    if ! "$PY" -c "import $module" 2>/dev/null; then
        echo "installing $module"
        timeout 120 "$PY" -m pip install -q "$module" || echo "could not install $module"
    fi
done
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/versions.txt"
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("triton", triton.__version__)
try:
    import transformers
    print("transformers", transformers.__version__)
except Exception as err:  # the kernels do not need it; tests that import kvcomp do
    print("transformers unavailable:", err)
assert torch.cuda.is_available(), "no CUDA device: run the CPU tests (make test) instead"
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, "SMs")
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: no usable CUDA torch/triton"; exit 1; }

echo "== kernel tests on the GPU (Triton vs torch references) =="
# Compiling each kernel variant is CPU work: spread the tests over processes when pytest-xdist is there.
PARALLEL=()
"$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n 8)
timeout 180 "$PY" -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" tests/test_kernels.py \
    --durations=5 2>&1 | tee "$OUT/test_kernels.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== kernel benchmark =="
timeout 150 "$PY" -m experiments.kernel_bench --contexts 8192 32768 131072 --out "$OUT" 2>&1 \
    | tee "$OUT/kernel_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== end to end on the GPU: the contract suite's generation tests, every compressor, a tiny model =="
# Ratio 0 equals transformers' own decoding, lossless decoding equals uncompressed decoding, a batch equals each
# prompt alone: on CUDA tensors, through the compressors' GPU paths and the Triton kernels inside a model. This
# needs the transformers range of pyproject.toml; a GPU image with another one skips the stage and says so.
if "$PY" -c "import kvcomp.cache, kvcomp.attention, kvcomp.generation" 2>/tmp/gpu_check_import.txt; then
    KVCOMP_TEST_DEVICE=cuda timeout 120 "$PY" -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" \
        tests/test_contract.py -k "exact_setting or lossless_decoding or batch_equals" -rf --durations=5 2>&1 \
        | tee "$OUT/test_end_to_end.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
    echo "skipped: kvcomp's model side does not import with this transformers: $(tail -1 /tmp/gpu_check_import.txt)" \
        | tee "$OUT/test_end_to_end.txt"
fi

echo "gpu_check: results in $OUT (status $status)"
exit $status
