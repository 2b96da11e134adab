"""Tiny random Llama checkpoints (with the real SmolLM2 tokenizer) and small data files for distill tests."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

TEXTS = [
    "The jury said the election was conducted well and praised the city for its manner of running it.",
    "Rain fell on the harbour all night; by morning the boats were pulling at their ropes.",
    "A function returns a value; a generator yields many values, one at a time, when asked.",
    "She opened the letter, read the first line twice, and put it back in the envelope.",
    "The committee will meet on Tuesday to discuss the budget for the coming school year.",
    "Light travels faster than sound, which is why thunder follows the flash of lightning.",
] * 4


def tiny_llama(path: Path, layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    from swiftkv_core.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def llama_70b_parameters(num_key_value_layers: int) -> tuple[int, int]:
    """Llama-3.1-70B's parameters counted from its shape: the base model's (all frozen in a distillation) and the
    trained ones, a query, a K and a V projection per layer >= l."""
    from swiftkv_core.flops import LLAMA_3_1_70B as shape

    H, L = shape.hidden_size, shape.num_hidden_layers
    kv = H // shape.num_attention_heads * shape.num_key_value_heads
    # embedding and LM head (untied), per layer q/k/v/o, the MLP's three and two norms, the final norm
    base = (
        2 * shape.vocab_size * H + L * (2 * H * H + 2 * H * kv + 3 * H * shape.intermediate_size + 2 * H) + H
    )
    return base, (L - num_key_value_layers) * (H * H + 2 * H * kv)


@pytest.fixture(scope="session")
def weightless_70b(tmp_path_factory, tiny_model) -> Path:
    """A Llama-3.1-70B checkpoint folder without its weights (the config and a tokenizer): what a run is sized by
    before it reads any weight; reading them fails."""
    from swiftkv_core.flops import LLAMA_3_1_70B as shape

    path = tmp_path_factory.mktemp("weightless") / "llama-70b"
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=256,
    )  # fmt: skip
    config.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


@pytest.fixture
def fp32_matmuls():
    """fp32 matmuls on a GPU (no TF32) for a test that compares two runs closely; restored after it."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "text.jsonl", [{"text": t} for t in TEXTS])


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory) -> Path:
    records = [
        {
            "messages": [
                {"role": "user", "content": "What is rain?"},
                {"role": "assistant", "content": "Water falling from clouds."},
            ]
        },
        {"prompt": "Name a colour."},
        {"prompt": "Say hi.", "response": "Hi!"},
    ] * 4
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", records)


def quiet_trainer(root, **kwargs) -> L.Trainer:
    """A Trainer without loggers, checkpoints or progress bar (the data module brings its own sampler), on the CPU
    unless ``accelerator`` says otherwise (Lightning's default would move a CPU test to a GPU where there is one)."""
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        use_distributed_sampler=False,
        default_root_dir=root,
    )
    return L.Trainer(**defaults | kwargs)
