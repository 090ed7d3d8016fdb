# tokenmill on the CPU: a slim, non-root image with the kernels compiled at build time.
#   docker build -t tokenmill .          (build args: BASE_IMAGE, TORCH_VERSION, TORCH_PIP_ARGS, KERNEL_VARIANTS)
# Without a registry for base images: a Debian base made with debootstrap (docs/api.md, "Container and monitoring").
#   docker run -p 8000:8000 -v ~/models:/models tokenmill /models/Qwen2.5-0.5B-Instruct --max-num-seqs 8
# The container runs `tokenmill serve --host 0.0.0.0 --port 8000 MODEL FLAGS... $TOKENMILL_ARGS`: flags go after the
# model on the command line, or in TOKENMILL_ARGS (`-e TOKENMILL_ARGS="--max-num-seqs 8"`); a later flag wins. The
# HEALTHCHECK asks port 8000's /health (a --port of your own needs a healthcheck of your own).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# where pip finds torch's CPU wheel: PyTorch's index (PyPI's torch for x86-64 Linux is the CUDA build, gigabytes with
# its CUDA wheels); elsewhere e.g. "--find-links http://HOST:PORT/" serving a folder that holds torch-*+cpu-*.whl
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# the kernel variants compiled now (the rest compile on first use, into the writable cache): the x86-64 levels a
# server CPU picks (AVX2: Zen 2/3; AVX-VNNI: Alder Lake on; AVX-512: Skylake-SP; AVX-512 VNNI: Cascade Lake, Ice Lake;
# AVX-512 BF16: Zen 4/5, Sapphire Rapids on)
ARG KERNEL_VARIANTS="avx2 avxvnni avx512 avx512vnni avx512bf16"
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_PIP_ARGS}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install ".[ray,otel]"
ENV TOKENMILL_CACHE_DIR=/opt/tokenmill-cache
# each variant compiles in a child process: one this build machine cannot run (AVX-512 on AVX2) cannot crash it
RUN python -m tokenmill.kernels.prebuild ${KERNEL_VARIANTS}

FROM ${BASE_IMAGE}
# the kernels that compile on first use (another variant, an edited build) need the compiler at run time too
RUN apt-get update && apt-get install -y --no-install-recommends g++ curl && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 tokenmill && mkdir /models && chown tokenmill /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=tokenmill /opt/tokenmill-cache /opt/tokenmill-cache
ENV PATH=/opt/venv/bin:$PATH TOKENMILL_CACHE_DIR=/opt/tokenmill-cache HF_HOME=/models/.hf PYTHONUNBUFFERED=1 \
    TOKENMILL_ARGS=""
USER tokenmill
VOLUME ["/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["/bin/sh", "-c", "exec tokenmill serve --host 0.0.0.0 --port 8000 \"$@\" $TOKENMILL_ARGS", "tokenmill"]
CMD ["demo"]
