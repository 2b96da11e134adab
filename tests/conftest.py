"""Shared fixtures: tiny random models of every supported family (unit tests) and the real SmolLM2 (integration)."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import swiftkv_core  # noqa: F401  (registers the SwiftKV classes)

# The tests' data files are new temporary files in every run: their token rows go to a folder of the run, not the
# user's token cache (nor a SWIFTKV_TOKENS_DIR the user set). The first process to import this file makes it
# (pytest, or its xdist controller) and deletes it when it exits; the processes it starts inherit it (the marker
# variable says so) and leave it alone.
if "_SWIFTKV_TESTS_TOKENS_DIR" not in os.environ:
    _TOKENS_DIR = tempfile.mkdtemp(prefix="swiftkv-tokens-")
    os.environ["_SWIFTKV_TESTS_TOKENS_DIR"] = os.environ["SWIFTKV_TOKENS_DIR"] = _TOKENS_DIR
    _MAKER = os.getpid()
    atexit.register(lambda: os.getpid() == _MAKER and shutil.rmtree(_TOKENS_DIR, ignore_errors=True))

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)

# head_dim 32 (hidden 64 over 2 heads) for the tiny models that run flex_attention on a CPU: torch 2.13's compiled CPU
# flex_attention is wrong below head_dim 32 on a CPU with AVX2 and no AVX-512 (swiftkv_core.runtime.check_flex_attention)
FLEX_HEADS = dict(num_attention_heads=2, num_key_value_heads=1)


def free_port() -> int:
    """A TCP port no process listens on now (a launcher's rendezvous, a server): tests that run at the same time on
    the other worker must not share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_base(family: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised 4-layer base model of ``family`` in eval mode."""
    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs, tie_word_embeddings=True))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**kwargs, sliding_window=None))
    else:
        raise ValueError(family)
    # Random init gives near-uniform outputs; scale up so greedy decisions are not coin flips on float noise.
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model.eval()


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def family(request):
    return request.param


@pytest.fixture(scope="session")
def smollm2_path():
    from swiftkv_core.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(smollm2_path),
    )


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two workers), each worker takes its share of the cores: the threads of
    its torch and of the processes it starts, and the cores the vLLM engines it starts bind their threads to (vLLM
    binds every engine to the same first cores by default, so two workers' engines would share one core)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or count is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    first = int(worker.removeprefix("gw")) % len(cores)  # a core, so the share below is never empty
    mine = cores[first :: int(count)]
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, mine))
    torch.set_num_threads(len(mine))


# Seconds of one worker's time for the longest test files (`make test` on the 2-core CI machine, 2026-11-28, eleventh
# session; compose and eval scaled by what their cuts saved alone; benchmarks/results/test-suite-workers.md). The
# workers take whole files in the order of the collection, longest first (`--no-loadscope-reorder` keeps it), so the
# run ends on short files, both workers busy until then; the files not named here are shorter and follow in their own
# order. Out-of-date figures only make the order less good.
LONGEST_FILES = {
    "tests/integration/test_quickstart.py": 405,
    "tests/core/test_attention.py": 305,
    "tests/serve/test_offline.py": 265,
    "tests/serve/test_compose.py": 265,
    "tests/distill/test_distributed.py": 185,  # 215 before its resume test moved (2026-12-06)
    "tests/integration/test_kill.py": 280,  # 215, and 66 s of the sharded checkpoint kill since
    "tests/integration/test_gpu_benchmark.py": 170,
    "tests/serve/test_soak.py": 140,
    "tests/serve/test_bench_answers.py": 120,
    "tests/integration/test_eval.py": 95,
    "tests/serve/test_serve_command.py": 90,
    "tests/serve/test_server.py": 80,
    "tests/distill/test_distributed_resume.py": 70,  # 2026-12-06, alone
    "tests/distill/test_module.py": 65,
    "tests/distill/test_distributed_data.py": 60,  # 2026-12-07, alone
    "tests/distill/test_attention.py": 55,
    "tests/serve/test_parallel.py": 55,
    "tests/integration/test_smollm2.py": 50,
}


def pytest_collection_modifyitems(config, items):
    """The longest test files first (a stable sort: each file's tests stay together, in their order). Tests marked
    ``gpu`` skip cleanly on machines without CUDA (ours and CI's)."""
    items.sort(key=lambda item: -LONGEST_FILES.get(item.nodeid.split("::")[0], 0))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def use_data_cache(monkeypatch, folder):
    """The offline data sets and the teacher answers go to ``folder`` (``teacher_answers/`` inside), not the
    user's cache."""
    from pathlib import Path

    from swiftkv_distill import answers, corpora

    monkeypatch.setattr(corpora, "data_dir", lambda: Path(folder))
    monkeypatch.setattr(answers, "answers_dir", lambda: Path(folder) / "teacher_answers")
