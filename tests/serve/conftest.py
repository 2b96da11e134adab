"""Fixtures for the serve tests: real checkpoints on disk, real vLLM engines (in-process, eager, small cache)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from pathlib import Path

import pytest

from tests.serve.checkpoints import smollm2_path, swiftkv_checkpoint, tiny_base

pytest.importorskip("vllm")


@pytest.fixture(scope="package", autouse=True)
def in_process_engines():
    """These tests' engines: the engine core in-process (about 6 s to start instead of 40 s) and a small CPU KV
    cache (GiB), a user's own settings kept. For this package's tests only: set at import, they reached the other
    packages' engines in a whole run (the main job's serving children) but not when those ran alone. vLLM's CPU
    platform writes its own settings into this process's environment as it builds an engine's config (LD_PRELOAD of
    torch's OpenMP library, LOCAL_WORLD_SIZE, VLLM_WORKER_MULTIPROC_METHOD): put back afterwards, so the processes
    that later tests in this worker start do not inherit them."""
    environ = dict(os.environ)
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        os.environ.setdefault(name, value)
    yield
    os.environ.clear()
    os.environ.update(environ)


# Prompt lengths around the chunk size below (48): short, split in two, split in several.
PROMPT_LENGTHS = (5, 37, 70, 130)
MAX_NUM_BATCHED_TOKENS = 48


def random_prompts(
    lengths=PROMPT_LENGTHS, seed: int = 0, low: int = 100, high: int = 49000
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


@contextlib.contextmanager
def vllm_engine(path: Path | str, **kwargs):
    """A ``vllm.LLM`` on ``path`` (fp32, eager, chunked prefill with small chunks), shut down afterwards; torch's
    process group and vLLM's parallel groups, set up before the model is built, are taken down even when building it
    fails (an in-process engine's refusal), or a later test in this process would find them."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    options = dict(
        dtype="float32",
        enforce_eager=True,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_chunked_prefill=True,
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
    )
    options.update(kwargs)
    llm = None
    try:
        llm = LLM(model=str(path), **options)
        yield llm
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()  # collects the engine's garbage too


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def teacher_forced_agreement(llm, prompts: list[list[int]], paths: list[list[int]]) -> float:
    """Fraction of the steps of ``paths`` (greedy continuations from another engine) where ``llm``'s greedy next
    token, after the prompt and the path so far, is the path's: a top-1 agreement that a near-tie early in a
    path cannot wreck, unlike comparing two greedy generations."""
    prefixes = [
        prompt + path[:k] for prompt, path in zip(prompts, paths, strict=True) for k in range(len(path))
    ]
    chosen = [tokens[0] for tokens in greedy(llm, prefixes, 1)]
    expected = [token for path in paths for token in path]
    return sum(a == b for a, b in zip(chosen, expected, strict=True)) / len(expected)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_llama(checkpoints) -> Path:
    return tiny_base(checkpoints / "tiny-llama")


def without_weights(checkpoint: Path, folder: Path) -> Path:
    """A copy of ``checkpoint`` without its weights files: an error it gets was raised before any weight is read."""
    copy = folder / f"{checkpoint.name}-without-weights"
    shutil.copytree(
        checkpoint, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json")
    )
    return copy


@pytest.fixture(scope="session")
def tiny_swiftkv(checkpoints, tiny_llama) -> Path:
    """8 layers, l=4, AcrossKV g=2, SwiftKV weights perturbed away from the teacher's; published layout."""
    return swiftkv_checkpoint(tiny_llama, checkpoints / "tiny-swiftkv-l4-g2", 4, 2, noise=0.5)


@pytest.fixture(scope="session")
def tiny_swiftkv_serving(checkpoints, tiny_llama) -> Path:
    """8 layers, l=4, g=1, written by export_for_serving (no teacher q/k/v for layers >= l)."""
    return swiftkv_checkpoint(
        tiny_llama, checkpoints / "tiny-swiftkv-l4-g1-serving", 4, 1, noise=0.5, serving=True, seed=1
    )


@pytest.fixture(scope="session")
def tiny_swiftkv_lora(checkpoints, tiny_llama) -> Path:
    """8 layers, l=4, g=2, rank-8 adapters on o_proj and the MLP of layers >= 4: the full checkpoint."""
    return swiftkv_checkpoint(
        tiny_llama, checkpoints / "tiny-swiftkv-l4-g2-lora", 4, 2, noise=0.5, seed=2, lora_rank=8
    )


@pytest.fixture(scope="session")
def tiny_swiftkv_lora_serving(checkpoints, tiny_llama) -> Path:
    """The same, written by export_for_serving: the adapters merged into o_proj and the MLP."""
    return swiftkv_checkpoint(
        tiny_llama, checkpoints / "tiny-swiftkv-l4-g2-lora-serving", 4, 2, noise=0.5, seed=2, lora_rank=8,
        serving=True,
    )  # fmt: skip


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return smollm2_path()


@pytest.fixture(scope="session")
def tiny_qwen2_swiftkv(checkpoints) -> Path:
    """A tiny random Qwen2 (q/k/v biases), 8 layers, l=6, AcrossKV g=2."""
    base = tiny_base(checkpoints / "tiny-qwen2", seed=2, family="qwen2")
    return swiftkv_checkpoint(base, checkpoints / "tiny-qwen2-swiftkv-l6-g2", 6, 2, noise=0.5, seed=2)
