# phasewatch's image: the package of pyproject.toml, installed the way `make test` installs it
# (`pip install -e .` from this source tree: app/store/migrate.py finds migrations/ beside
# app/), started as `phasewatch serve`. The same image runs the simulator (`phasewatch sim`) for
# machines without a GPU (docker-compose.yml, profile `sim`).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /srv/phasewatch
COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY migrations ./migrations
RUN pip install -e . \
    && useradd --system --uid 10001 --home-dir /var/lib/phasewatch --create-home phasewatch

USER phasewatch
# Listen on every interface inside the container. Without PHASEWATCH_DATABASE_URL records go to
# an SQLite file in the user's home (mount a volume there to keep it); docker-compose.yml and
# the Kubernetes manifests point it at Postgres, which replicas share.
ENV PHASEWATCH_HOST=0.0.0.0 \
    PHASEWATCH_PORT=8080 \
    PHASEWATCH_DATABASE_URL=sqlite+aiosqlite:////var/lib/phasewatch/phasewatch.db
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/api/health', timeout=2)"]

ENTRYPOINT ["phasewatch"]
CMD ["serve"]
