# vLLM's OpenAI image with KVStoreTier layered on: the kvstore package installed beside vLLM without
# changing any package vLLM brought (the build fails rather than up- or downgrade one). Build from the
# repository root:
#   docker build -f compose/vllm/vllm-kvstore.Dockerfile -t kvstore-vllm:dev .
# The tier is then selected in --kv-transfer-config (compose/vllm/kv-transfer-config.json).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

WORKDIR /tmp/kvstore-build
COPY pyproject.toml README.md ./
COPY kvstore/ kvstore/
COPY connector/ connector/
COPY admin/ admin/
COPY migrations/ migrations/
# vLLM's packages, pinned as the image has them, constrain kvstore's dependencies (which only add packages).
RUN python3 -m pip list --format=freeze | grep -v '^kvstore==' > /tmp/vllm-image.txt \
    && python3 -m pip install --constraint /tmp/vllm-image.txt . \
    && python3 -c "import kvstore.connector.tier" \
    && rm -rf /tmp/kvstore-build /tmp/vllm-image.txt
COPY compose/vllm/vllm-entrypoint.sh /usr/local/bin/vllm-entrypoint.sh
WORKDIR /
ENTRYPOINT ["/bin/bash", "/usr/local/bin/vllm-entrypoint.sh"]
