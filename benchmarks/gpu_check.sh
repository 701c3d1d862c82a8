#!/usr/bin/env bash
# One GPU check, under 8 minutes on an H200: the Triton kernel tests on CUDA (every kernel vs the reference in
# fp32/fp16/bf16, CUDA dispatch of torch.ops.flashcodec, opcheck on CUDA, CUDA-graph capture + replay of
# append + codec_attention), then benchmarks/bench_attention.py (S = 4k..128k, bf16).
# Everything lands in $OUT (default benchmarks/results/gpu_check): env.log, gpu_tests.xml (junit),
# gpu_tests.log, attention_cuda.json, bench_attention.log. Nothing is installed or downloaded: the package
# imports from this checkout through PYTHONPATH. Exit status: 0 when tests and benchmark both succeed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels on the GPU, not the interpreter
PY="${PYTHON:-python3}"

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/env.log" || exit 2
import platform, torch, triton
assert torch.cuda.is_available(), "no CUDA device"
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__,
      "device", torch.cuda.get_device_name(0))
PYEOF

# Each test compiles its own kernel variants: spread them over 8 processes when pytest-xdist is there.
PARALLEL=()
if "$PY" -c "import xdist" 2>/dev/null; then PARALLEL=(-n 8); fi
status=0
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rfEs "${PARALLEL[@]}" --junitxml="$OUT/gpu_tests.xml" \
    tests/ops/test_triton_cuda.py tests/ops/test_triton_attention.py tests/ops/test_triton_append.py \
    tests/ops/test_triton_blocks.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
timeout 150 "$PY" benchmarks/bench_attention.py --device cuda --out "$OUT/attention_cuda.json" 2>&1 \
    | tee "$OUT/bench_attention.log" || status=1
exit $status
