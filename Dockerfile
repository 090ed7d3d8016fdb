# tokenmill on the CPU: a slim, non-root image with the kernels compiled at build time.
#   docker build -t tokenmill .                       (BASE_IMAGE, TORCH_VERSION, KERNEL_VARIANTS: build args)
#   docker run -p 8000:8000 -v ~/models:/models tokenmill /models/Qwen2.5-0.5B-Instruct --max-num-seqs 8
# The container runs `tokenmill serve --host 0.0.0.0 --port 8000 MODEL FLAGS... $TOKENMILL_ARGS`: flags go after the
# model on the command line, or in TOKENMILL_ARGS (`-e TOKENMILL_ARGS="--max-num-seqs 8"`); a later flag wins. The
# HEALTHCHECK asks port 8000's /health (a --port of your own needs a healthcheck of your own).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# the kernel variants compiled now (the rest compile on first use, into the writable cache): a baseline and AVX-512
ARG KERNEL_VARIANTS="avx2 avx512"
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install ".[ray,otel]"
ENV TOKENMILL_CACHE_DIR=/opt/tokenmill-cache
RUN for v in ${KERNEL_VARIANTS}; do python -c "from tokenmill.kernels.build import load; load('$v')"; done

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
