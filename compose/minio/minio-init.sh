#!/bin/sh
# Create the kvstore bucket once MinIO answers; safe to re-run.
set -eu
mc alias set local http://minio:9000 "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD"
mc mb --ignore-existing local/kv-cache
