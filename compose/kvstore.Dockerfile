# The kvstore admin/CLI image: `kvstore serve` (the node sidecar / fleet controller), `kvstore gc` (cron),
# and every other command. Build from the repository root:
#   docker build -f compose/kvstore.Dockerfile -t kvstore:dev .
# (compose/kvstore.Dockerfile.dockerignore keeps the context to the files below.)
FROM python:3.11-slim

# One writable place for the embedded S3 server, the default cache and the demo; no bytecode in the image.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    XDG_DATA_HOME=/var/lib \
    KVSTORE_CACHE_DIR=/var/cache/kvstore

WORKDIR /build
# The package and nothing else (no tests, no virtualenvs): the four folders setuptools maps to kvstore.*.
COPY pyproject.toml README.md ./
COPY kvstore/ kvstore/
COPY connector/ connector/
COPY admin/ admin/
COPY migrations/ migrations/
RUN pip install . \
    && rm -rf /build \
    && useradd --system --uid 10001 --home-dir /var/lib/kvstore --create-home kvstore \
    && mkdir -p /var/cache/kvstore \
    && chown kvstore:kvstore /var/cache/kvstore

USER kvstore
WORKDIR /var/lib/kvstore
EXPOSE 8750
ENTRYPOINT ["kvstore"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8750"]
