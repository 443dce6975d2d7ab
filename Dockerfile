# One image for every meshserve service; the container's command picks the role:
#   docker build -t meshserve .
#   docker run meshserve serve gateway --nats-url nats://nats:4222 --host 0.0.0.0 --port 8000
# See docs/deploy.md.
FROM python:3.11-slim

# EXTRAS=cuda adds CuPy (the project's `cuda` extra). torch comes from TORCH_INDEX_URL: the CPU
# build by default; https://pypi.org/simple gives PyPI's torch, the CUDA build on Linux x86_64.
ARG EXTRAS=""
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# PULL_MODEL=true bakes the default model into the image's cache (no PyPI access needed at run time).
ARG PULL_MODEL=false

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MESHSERVE_CACHE=/var/cache/meshserve \
    MESHSERVE_SHM_DIR=/dev/shm

# torch first, in its own layer: it is most of the image and changes far less often than the code.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

WORKDIR /opt/meshserve
COPY pyproject.toml setup.py README.md ./
COPY meshserve ./meshserve
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
COPY bench ./bench
COPY cli ./cli
# torch==2.13.0 is already satisfied (2.13.0+cpu counts), so this does not fetch another build.
RUN pip install ".${EXTRAS:+[${EXTRAS}]}"

# A fixed uid so files one container creates in the shared /dev/shm are usable by the others.
RUN useradd --uid 10001 --create-home meshserve \
    && mkdir -p "${MESHSERVE_CACHE}" \
    && chown meshserve:meshserve "${MESHSERVE_CACHE}"
USER meshserve

RUN if [ "${PULL_MODEL}" = "true" ]; then meshserve models pull; fi

EXPOSE 8000
ENTRYPOINT ["meshserve"]
CMD ["--help"]
