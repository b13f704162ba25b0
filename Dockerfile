# loraplex, CPU image: `docker build -t loraplex:latest .` from the repository root.
# The install is the README's quick start step (scripts/install.sh), nothing else, so
# the image and a fresh machine install the same things.
#
# CUDA variant: build FROM an nvidia/cuda:12.x runtime image with Python 3.11 and pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (torch 2.13.0's CUDA
# build; Triton 3.7.1 comes with it). Nothing else changes: on CUDA the engine picks
# the Triton kernels.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The torch wheel index (CPU by default, so pip never pulls the CUDA build); the native
# CPU kernels compile on first use, which needs a C++ compiler in the image.
ENV PIP_EXTRA_INDEX_URL=${TORCH_INDEX} \
    PIP_NO_CACHE_DIR=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    PATH=/app/.venv/bin:${PATH}
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
RUN bash scripts/install.sh

EXPOSE 8000 8265 6379 8080
# Standalone: the demo config with the proxy on every interface (`docker run -p
# 8000:8000 loraplex`). Under KubeRay the pods run `ray start` instead, and the
# RayService (deploy/kuberay/rayservice.yaml) brings the same serve config.
CMD ["/bin/sh", "-c", "sed 's/host: 127.0.0.1/host: 0.0.0.0/' serve_config.yaml > /tmp/serve_config.yaml && exec serve run /tmp/serve_config.yaml"]
