"""A tiny random Qwen3-Next model, tokenizer and data set on disk, all offline.

Used by ``chunkscan lora --demo``, the tests and ``bench/lora.py``. The model keeps
Qwen3-Next's layer pattern (three Gated DeltaNet layers, then one full-attention
layer) and its real linear-attention head size (``Dk = Dv = 128``), with few heads,
a small MLP and a small vocabulary, so that the recurrence dominates training memory.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import random
from typing import Any

import mlx.core as mx

WORDS = tuple(
    (
        "zero one two three four five six seven eight nine ten eleven twelve "
        "red green blue black white the a of and to is in it on at cat dog bird fish"
    ).split()
)
SPECIALS = ("<unk>", "<pad>", "<eos>")


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A ``config.json`` for a small dense ``qwen3_next`` model (4 layers)."""
    config = {
        "model_type": "qwen3_next",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "intermediate_size": 512,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
        "num_experts_per_tok": 1,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0,
        "moe_intermediate_size": 0,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "vocab_size": 256,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "eos_token_id": SPECIALS.index("<eos>"),
    }
    config.update(overrides)
    return config


def build_model(config: dict[str, Any], seed: int = 0):
    """Instantiate the mlx-lm model for ``config`` with random weights (float32)."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def write_tokenizer(path: pathlib.Path) -> None:
    """Save a word-level ``tokenizer.json`` that ``mlx_lm.load`` reads offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "eos_token": "<eos>",
                "model_max_length": 1 << 20,
                # the messages' words in turn: prompt / completion and chat data need a
                # chat template (without one, mlx-lm's traceback; found by probing)
                "chat_template": _CHAT_TEMPLATE,
            },
            indent=2,
        )
    )


def write_model(path: str | pathlib.Path, config: dict[str, Any] | None = None, seed: int = 0):
    """Write ``config.json``, ``model.safetensors`` and the tokenizer to ``path``."""
    from mlx.utils import tree_flatten

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config() if config is None else config
    model = build_model(config, seed)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path)
    return path


def sentence(rng: random.Random, n_words: int) -> str:
    """A learnable sequence: counting words that wrap around, then a colour."""
    start = rng.randrange(13)
    numbers = WORDS[:13]
    words = [numbers[(start + i) % 13] for i in range(n_words)]
    return " ".join(words + [rng.choice(("red", "green", "blue"))])


#: What :func:`write_dataset` writes (``mlx_lm.lora``'s split names).
DATASET_FILES = ("train.jsonl", "valid.jsonl", "test.jsonl")


def write_dataset(
    path: str | pathlib.Path,
    n_train: int = 64,
    n_valid: int = 8,
    min_words: int = 40,
    max_words: int = 120,
    seed: int = 0,
    keep_existing: bool = False,
) -> pathlib.Path:
    """Write ``train.jsonl``, ``valid.jsonl`` and ``test.jsonl`` (as many lines as the
    validation set: ``chunkscan lora --demo --test`` stopped at mlx-lm's "Test set not
    found or empty" without it) of ``{"text": ...}`` lines. ``keep_existing``: leave a
    split that is already there as it is (the same lines for the others either way)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for name, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        lines = [sentence(rng, rng.randint(min_words, max_words)) for _ in range(n)]
        target = path / f"{name}.jsonl"
        if keep_existing and target.exists():
            continue
        with open(target, "w") as f:
            f.writelines(json.dumps({"text": text}) + "\n" for text in lines)
    return path
