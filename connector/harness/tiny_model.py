"""A tiny, offline, deterministic Llama model directory for real-engine tests.

vLLM needs a model directory to start; these machines have no model hub access, so
tests build one locally: a Llama config (4 layers, hidden 256), seeded random bf16 weights
in safetensors, and a byte-level BPE tokenizer trained on built-in text. The output is
meaningless text but fully deterministic, which is all KV-cache tests need: the same
prompt gives the same KV bytes and the same greedy tokens on every build.

Usage: ``build_tiny_model(path)`` or ``python -m kvstore.connector.harness.tiny_model DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["TinyModelSpec", "build_tiny_model", "sample_text"]

# Bump when the produced files change in any way, so stale directories get rebuilt.
_FORMAT_VERSION = 3
_MARKER = "kvstore_tiny_model.json"

_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|user|>", "<|assistant|>", "<|system|>"]

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_WORD_TEXT = (
    "the a an of to in and or for with on at by from cache key value token block chunk prefix model "
    "layer head store load tier object storage memory disk network region bucket index agent session "
    "turn history prompt system user assistant reply request engine scheduler worker copy read write "
    "hash checksum compress evict pin warm collect garbage budget time fast slow large small first "
    "last next previous shared local remote primary secondary python vector matrix tensor float "
    "integer string byte bit page file path name version is are was were be been has have had do "
    "does did can could will would should may might quick brown fox jumps over lazy dog lorem ipsum "
    "dolor sit amet consectetur adipiscing one two three four five six seven eight nine ten hundred "
    "thousand million zero"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the produced bytes; its hash makes builds idempotent."""

    num_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 4096
    max_position_embeddings: int = 16384
    seed: int = 1234
    format_version: int = _FORMAT_VERSION

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def sample_text(num_words: int, seed: int = 0) -> str:
    """Deterministic pseudo-English text; also handy for building long test prompts."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(num_words):
        word = rng.choice(_WORDS)
        out.append(word.capitalize() if i % 13 == 0 else word)
        if i % 13 == 12:
            out[-1] += rng.choice([".", ",", ";", "!", "?"])
    return " ".join(out)


def _corpus(seed: int) -> list[str]:
    """Training text: seeded word salad plus digits, punctuation and code-like lines."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "ng", "st", "qu", "x"]
    lines = [sample_text(60, seed=seed + i) for i in range(400)]
    # Pseudo-words give BPE enough distinct material to reach a vocab of a few thousand.
    lines += [
        " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(40))
        for _ in range(1500)
    ]
    lines += [f"{i} + {i * 7 % 97} = {i + i * 7 % 97}; x[{i}] = {{'k': {i * 3}}}" for i in range(200)]
    lines += ["def f(x):\n    return x * 2\n", "SELECT key, value FROM cache WHERE hit = 1;"]
    return lines


def _train_tokenizer(spec: TinyModelSpec, out: Path) -> tuple[int, int, int]:
    """Train a byte-level BPE tokenizer, write the HF tokenizer files.

    Returns (vocab size, bos id, eos id).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    bos, eos = _SPECIAL_TOKENS[0], _SPECIAL_TOKENS[1]
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "pad_token": eos}, indent=2)
    )
    bos_id, eos_id = tok.token_to_id(bos), tok.token_to_id(eos)
    assert bos_id is not None and eos_id is not None
    return int(tok.get_vocab_size()), bos_id, eos_id


def _write_model(spec: TinyModelSpec, vocab: int, bos_id: int, eos_id: int, out: Path) -> None:
    """Write config.json and seeded random bf16 weights in Llama's parameter naming."""
    import torch
    from safetensors.torch import save_file

    head_dim = spec.hidden_size // spec.num_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}, indent=2)
    )

    gen = torch.Generator().manual_seed(spec.seed)
    h, inter, kv = spec.hidden_size, spec.intermediate_size, spec.num_kv_heads * head_dim

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    # Random weights alone give near-flat bf16 logits, so greedy decoding flips on rounding
    # noise (a cached prefix and a recomputed one then disagree). Instead the output head is
    # the embedding matrix under a fixed permutation: the residual stream keeps the current
    # token's embedding, so token x predicts perm(x) by a wide margin, while sharp random
    # attention makes the logprobs depend on the context (i.e. on the KV cache).
    embed = rnd(vocab, h, std=1.0)
    perm = torch.randperm(vocab, generator=gen)
    lm_head = torch.empty_like(embed)
    lm_head[perm] = embed * 0.045
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = rnd(h, h, std=0.15)
        tensors[p + "self_attn.k_proj.weight"] = rnd(kv, h, std=0.15)
        tensors[p + "self_attn.v_proj.weight"] = rnd(kv, h, std=0.1)
        tensors[p + "self_attn.o_proj.weight"] = rnd(h, h, std=0.04)
        tensors[p + "mlp.gate_proj.weight"] = rnd(inter, h, std=0.02)
        tensors[p + "mlp.up_proj.weight"] = rnd(inter, h, std=0.02)
        tensors[p + "mlp.down_proj.weight"] = rnd(h, inter, std=0.02)
        tensors[p + "input_layernorm.weight"] = ones(h)
        tensors[p + "post_attention_layernorm.weight"] = ones(h)
    tensors["model.norm.weight"] = ones(h)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def build_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """Build the model directory at ``path`` (skipped if already built with the same spec).

    The build goes to a temporary sibling directory that is renamed into place, so a crash
    never leaves a half-written model that a later call would mistake for a finished one.
    """
    spec = spec or TinyModelSpec()
    dest = Path(path)
    marker = dest / _MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("digest") == spec.digest():
                return dest
        except (OSError, ValueError):
            pass
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.build-", dir=dest.parent))
    try:
        vocab, bos_id, eos_id = _train_tokenizer(spec, tmp)
        _write_model(spec, vocab, bos_id, eos_id, tmp)
        (tmp / _MARKER).write_text(json.dumps({"digest": spec.digest(), "spec": asdict(spec)}, indent=2))
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m kvstore.connector.harness.tiny_model DIR")
    print(build_tiny_model(sys.argv[1]))
