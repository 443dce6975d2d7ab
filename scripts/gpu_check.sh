#!/usr/bin/env bash
# The CUDA backend's check on a GPU machine: the CUDA tests (kernels against their CPU reference,
# copy/swap, CUDA IPC across processes, the engine against Transformers) and the GPU benchmark.
#
#   bash scripts/gpu_check.sh            (from anywhere; $OUT collects the results, else a temp dir)
#   device tool: run(command="bash scripts/gpu_check.sh", carry=[], timeout_s=420)
#
# Writes to $OUT: env.txt, compile.log, pytest.log, gpu_bench.json, gpu_bench.log. Needs python3
# with torch, cupy, transformers, tokenizers, safetensors, numpy and pytest; nothing is installed:
# the repository is made importable as `meshserve` through a PYTHONPATH shim (what setup.py maps:
# meshserve.shared/.services/.kernels -> shared/, services/, kernels/), and none of the modules
# these steps import needs pydantic, orjson or gguf. On a machine without a GPU the CUDA tests
# skip (the CPU emulation and nvcc tests still run) and the benchmark says so. PYTHON overrides
# the interpreter. Every step has its own time limit; the whole stays under 6 minutes.
set -x
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

SHIM="$(mktemp -d)"
mkdir -p "$SHIM/meshserve"
cp meshserve/__init__.py "$SHIM/meshserve/"
for pkg in shared services kernels; do ln -s "$PWD/$pkg" "$SHIM/meshserve/$pkg"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1           # the repository root's meshserve/ (an __init__.py only) must not shadow the shim
export PYTHONUNBUFFERED=1
export MESHSERVE_DISABLE_CPU_KERNELS=1  # the CPU extensions are not what this checks (and their build takes a minute)
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

{
  date -u
  command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
  command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc: not found"
  timeout 120 "$PY" - <<'PYEOF'
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
PYEOF
} 2>&1 | tee "$OUT/env.txt"

# The kernels compile (NVRTC through CuPy); a failure prints NVRTC's log here, before the tests.
timeout 120 "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/compile.log"
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
timeout 210 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_cuda_kernels.py 2>&1 | tee "$OUT/pytest.log"
echo "pytest exit: $?"
timeout 150 "$PY" -m meshserve.services.bench.gpu_bench --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log"
echo "gpu_bench exit: $?"
set +x
echo "=== pytest summary"; grep -E "passed|failed|error|FAILED|ERROR" "$OUT/pytest.log" | tail -n 40
ls -la "$OUT"
