#!/bin/bash
# Install kvstore next to the image's vLLM (no dependency changes to vLLM itself), then serve with the tier.
set -euo pipefail
cp -r /src /tmp/kvstore
pip install --no-cache-dir --no-deps /tmp/kvstore
pip install --no-cache-dir minio lmdb zstandard xxhash pydantic-settings prometheus-client msgspec pyzmq typer rich
exec vllm serve "$MODEL" --host 0.0.0.0 --port 8000 \
  --kv-transfer-config "$(cat /config/kv-transfer-config.json)"
