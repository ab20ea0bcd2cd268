"""Token ids from a model directory's tokenizer and chat template, against transformers' own."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.hashing import block_hashes
from kvstore.prompts import tokens_from_messages, tokens_from_prompt


@pytest.fixture
def model_dir(tiny_model: Path) -> Path:
    return tiny_model


def test_prompt_and_messages_match_transformers(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    prompt = "the cache key of a shared prefix " * 20
    assert tokens_from_prompt(model_dir, prompt) == hf(prompt)["input_ids"]
    messages = [{"role": "system", "content": "You are a helpful storage agent. " * 10}]
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert tokens_from_messages(model_dir, messages) == list(expected)
    # The system-only head is a token prefix of the whole conversation, so its full chunks are shared.
    full = [*messages, {"role": "user", "content": "hello"}]
    head, whole = tokens_from_messages(model_dir, messages), tokens_from_messages(model_dir, full)
    assert whole[: len(head)] == head
    assert block_hashes(head, 16) == block_hashes(whole, 16)[: len(head) // 16]


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        tokens_from_prompt(tmp_path, "x")
    with pytest.raises(ConfigError, match="tokenizer_config"):
        tokens_from_messages(tmp_path, [{"role": "system", "content": "x"}])
