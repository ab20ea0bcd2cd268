#!/bin/bash
# Serve $MODEL with KVStoreTier behind vLLM's CPU tier (the image has kvstore installed; see
# vllm-kvstore.Dockerfile). The tier's settings are in the mounted --kv-transfer-config; its S3 credentials
# come from the environment, like any vLLM process's.
set -euo pipefail
exec vllm serve "$MODEL" --host 0.0.0.0 --port 8000 \
  --kv-transfer-config "$(cat /config/kv-transfer-config.json)" "$@"
