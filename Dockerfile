# phasewatch's production image, in two stages:
#   build:   the wheel, from this source tree (what `pip wheel .` makes, and the tests install),
#            with the native relay compiled in (app/phasewatch/proxy/csrc/: the stage's C
#            compiler);
#   runtime: the locked dependencies (requirements.lock, every version and hash pinned) and that
#            wheel, installed by deploy/install-runtime.sh (the tests run the same script) into
#            /opt/phasewatch, run as a non-root user. No source tree, no compiler, no editable
#            install: migrations ship inside the package.
# The image holds the `postgres` and `otel` extras (OpenTelemetry stays off unless
# PHASEWATCH_OTEL_ENABLED is set). The same image runs the simulator (`phasewatch sim`) for machines without a GPU
# (docker-compose.yml, profile `sim`).
FROM python:3.11-slim AS build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY app ./app
RUN pip install --no-cache-dir build==1.6.1 \
    && python -m build --wheel --outdir /dist \
    && python -c "import sys, zipfile, glob; names = zipfile.ZipFile(glob.glob('/dist/*.whl')[0]).namelist(); sys.exit(not all(any(n.startswith(m) for n in names) for m in ('phasewatch/proxy/_native',)))"

FROM python:3.11-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements.lock deploy/install-runtime.sh /tmp/install/
COPY --from=build /dist/ /tmp/install/dist/
RUN sh /tmp/install/install-runtime.sh /opt/phasewatch /tmp/install/requirements.lock \
        "$(ls /tmp/install/dist/phasewatch-*.whl)" \
    && rm -rf /tmp/install \
    && useradd --system --uid 10001 --home-dir /var/lib/phasewatch --create-home phasewatch

USER 10001
WORKDIR /var/lib/phasewatch
# Listen on every interface inside the container. Without PHASEWATCH_DATABASE_URL records go to
# an SQLite file in the user's home (mount a volume there to keep it); docker-compose.yml and
# the Kubernetes manifests point it at Postgres, which replicas share.
ENV PATH=/opt/phasewatch/bin:$PATH \
    PHASEWATCH_HOST=0.0.0.0 \
    PHASEWATCH_PORT=8080 \
    PHASEWATCH_DATABASE_URL=sqlite+aiosqlite:////var/lib/phasewatch/phasewatch.db
EXPOSE 8080
# Open files: `serve` raises its soft limit to the hard one the runtime gives it (four
# descriptors per stream with the native relay, two without) and logs the streams that allows. An image cannot raise the hard
# limit itself: run it with `--ulimit nofile=65536:65536` (docker-compose.yml sets it; on
# Kubernetes the container runtime's default, usually 1048576, applies).
# Healthy means ready: serving, not draining, records being stored (GET /api/ready).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/api/ready', timeout=2)"]

ENTRYPOINT ["phasewatch"]
CMD ["serve"]
