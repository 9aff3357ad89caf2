#!/usr/bin/env bash
# On a CUDA machine: the kernel tests on the GPU, then the kernel benchmark (achieved GB/s of the fused
# quantized and sparse decode kernels against the device's copy bandwidth, 8K-128K tokens). About 3-5 minutes;
# each stage has its own time limit so the whole script ends within 8.
#
#   bash experiments/gpu_check.sh            # results in runs/gpu_check/ (OUT=... to change)
#
# Needs python3 with a CUDA build of torch, triton, transformers and pytest (a GPU image usually has them);
# what is missing is installed with pip when a package index is reachable. kvcomp is used from this checkout
# (PYTHONPATH), not installed, so nothing is built.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
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
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py --durations=5 \
    --junitxml "$OUT/test_kernels.xml" 2>&1 | tee "$OUT/test_kernels.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== kernel benchmark =="
timeout 200 "$PY" -m experiments.kernel_bench --contexts 8192 32768 131072 --out "$OUT" 2>&1 \
    | tee "$OUT/kernel_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu_check: results in $OUT (status $status)"
exit $status
