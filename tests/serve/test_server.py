"""`vllm serve` on a SwiftKV checkpoint (the plugin loaded through its entry point), OpenAI API on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from swiftkv_serve.server import free_port
from tests.serve.checkpoints import hf_greedy
from tests.serve.conftest import random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_CONCURRENT = 32
MAX_TOKENS = 8


def _post(url: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.fixture(scope="module")
def server(tiny_swiftkv, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server as users run it
    # `swiftkv-serve CHECKPOINT ...` is `vllm serve CHECKPOINT ...` (its module form with vllm-cpu, see cli.py).
    command = [
        str(Path(sys.executable).parent / "swiftkv-serve"),
        str(tiny_swiftkv),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--max-num-batched-tokens",
        "48",
        "--max-num-seqs",
        str(NUM_CONCURRENT),
        "--seed",
        "0",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up in 240 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base, str(tiny_swiftkv)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _complete(base: str, model: str, prompt: list[int], **extra) -> tuple[int, dict]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }
    return _post(f"{base}/v1/completions", body)


def test_concurrent_requests_match_offline(server, tiny_swiftkv):
    base, model = server
    prompts = random_prompts(lengths=(3, 20, 47, 49, 90, 130, 200, 9), seed=7)
    expected = hf_greedy(tiny_swiftkv, prompts, MAX_TOKENS)  # == offline vLLM (test_offline)
    jobs = [i % len(prompts) for i in range(NUM_CONCURRENT)]
    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        results = list(pool.map(lambda i: _complete(base, model, prompts[i]), jobs))
    for i, (status, body) in zip(jobs, results, strict=True):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == expected[i]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        ({"prompt": [1, 2, 3], "max_tokens": -5}, 400),
        ({"prompt": [1, 2, 3], "max_tokens": 2, "prompt_logprobs": 1}, 400),
        ({"prompt": list(range(100, 700)), "max_tokens": 2}, 400),  # longer than max_model_len
        ({"prompt": [1, 2, 3], "max_tokens": 2, "model": "no-such-model"}, 404),
    ],
    ids=["bad-json", "negative-max-tokens", "prompt-logprobs", "too-long", "unknown-model"],
)
def test_malformed_requests_get_4xx_and_server_keeps_serving(server, body, status):
    base, model = server
    if isinstance(body, dict):
        body = {"model": model, **body}
    got, response = _post(f"{base}/v1/completions", body)
    assert got == status, response
    ok, response = _complete(base, model, [101, 102, 103])
    assert ok == 200 and len(response["choices"][0]["token_ids"]) == MAX_TOKENS


@pytest.mark.parametrize(
    "extra",
    [{"prompt_logprobs": 0}, {"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}],
    ids=["prompt-logprobs-0", "prompt-logprobs-1", "echo-logprobs"],
)
def test_prompt_logprobs_refused_with_the_reason(server, extra):
    """Every way of asking for prompt logprobs gets a 400 that says why (vLLM's own check under fast prefill
    answers first for prompt_logprobs >= 1; the plugin's admission check catches the rest)."""
    base, model = server
    status, response = _complete(base, model, [101, 102, 103], **extra)
    assert status == 400, response
    message = response["error"]["message"]
    assert (
        "prompt_logprobs are not supported by SwiftKV" in message or "logprobs for prompt tokens" in message
    )
