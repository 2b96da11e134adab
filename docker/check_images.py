"""Checks the CPU images for real (run by scripts/docker-test.sh, i.e. `make docker-test`, with the workspace's
Python: `.venv/bin/python docker/check_images.py serve|train WORKDIR`).

serve: the serving image on a SwiftKV serving export of the default model (SmolLM2-135M-Instruct, l=15): waits
    for /health and Docker's own HEALTHCHECK, sends completions and chat requests at temperature 0 and compares
    the answers token for token with swiftkv_core's HF greedy output of the same checkpoint, checks that malformed
    requests get a 4xx while the server keeps serving, and that `docker stop` ends it cleanly.
train: a few-step `swiftkv-distill fit` of the default model inside the training image, then the same through
    `fabric run` with 2 processes (FSDP2), and loads each export outside the container; then the main job
    (`swiftkv quickstart`, short settings, lm-eval on a local task) with no network at all: the image holds the
    model, the data and lm-eval; killed and run again, it resumes from the mounted results folder; and
    `benchmarks/gpu.py --tiny` (the GPU benchmark's every part, on a tiny shape) offline, into a mounted folder.

Containers use --network host (our machines have no bridge); users publish the port with -p 8000:8000.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from swiftkv_serve.server import free_port, healthy  # the host side runs in the workspace's venv

SERVE_IMAGE = os.environ.get("SERVE_IMAGE", "swiftkv-serve:cpu")
TRAIN_IMAGE = os.environ.get("TRAIN_IMAGE", "swiftkv-train:cpu")
MAX_TOKENS = 24
# the quickstart's header of its fifth stage: the four before it are recorded by then
DISTILL_STAGE = "== 5/10 distill"
COMPLETION_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
CHATS = [[{"role": "user", "content": "What is the boiling point of water at sea level?"}],
         [{"role": "system", "content": "You are a concise assistant."},
          {"role": "user", "content": "Name three primary colours."}]]  # fmt: skip


def log(message: str) -> None:
    print(f"[docker-test] {message}", flush=True)


def docker(*args: str, check: bool = True) -> str:
    """``docker ARGS``' output; ``docker logs`` writes the container's stderr to stderr, so both are kept."""
    result = subprocess.run(["docker", *args], check=False, text=True, capture_output=True)
    if check and result.returncode != 0:
        raise SystemExit(f"docker {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return (result.stdout + (result.stderr if args[0] == "logs" else "")).strip()


def post(url: str, body: bytes | dict, timeout: float = 300) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


# ---------------------------------------------------------------------------------------------------- serving
def serving_checkpoint(work: Path) -> Path:
    """A SwiftKV serving export of the default model (l=15 of 30, no distillation: equality needs none)."""
    out = work / "smollm2-swiftkv-l15-serving"
    if not (out / "config.json").is_file():
        swiftkv = Path(sys.executable).parent / "swiftkv"
        subprocess.run(
            [
                str(swiftkv),
                "convert",
                "--out_dir",
                str(out),
                "--num_key_value_layers",
                "15",
                "--serving",
                "true",
            ],
            check=True,
        )
    subprocess.run(["chmod", "-R", "a+rX", str(work)], check=True)  # the image's user (uid 1000) reads it
    return out


def hf_greedy(checkpoint: Path) -> tuple[list[list[int]], list[list[int]], object]:
    """swiftkv_core's HF greedy continuations of the completion prompts and of the chats (template applied)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import swiftkv_core  # noqa: F401  (registers llama_swiftkv)
    from swiftkv_core.chat import chat_ids

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaSwiftKVForCausalLM", type(model)

    def greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        return out[0, len(ids) :].tolist()

    completions = [greedy(tokenizer(p)["input_ids"]) for p in COMPLETION_PROMPTS]
    chats = [greedy(chat_ids(tokenizer, c, generation_prompt=True)) for c in CHATS]
    return completions, chats, tokenizer


def strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def check_serve(work: Path) -> None:
    checkpoint = serving_checkpoint(work)
    log(f"checkpoint: {checkpoint}")
    t0 = time.monotonic()
    completions, chats, tokenizer = hf_greedy(checkpoint)
    log(
        f"HF greedy (swiftkv_core, fp32): {len(completions)} completions + {len(chats)} chats in {time.monotonic() - t0:.0f} s"
    )

    port = free_port()
    name = f"swiftkv-serve-test-{port}"
    command = [
        "run", "-d", "--name", name, "--network", "host", "--shm-size", "1g",
        "-v", f"{checkpoint}:/model:ro",
        SERVE_IMAGE, "/model",
        "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--seed", "0",
    ]  # fmt: skip
    log("docker " + " ".join(command))
    docker("rm", "-f", name, check=False)
    docker(*command)
    base = f"http://127.0.0.1:{port}"
    failures: list[str] = []
    try:
        t0 = time.monotonic()
        while True:
            if docker("inspect", "-f", "{{.State.Running}}", name) != "true":
                raise SystemExit(f"the server container exited:\n{docker('logs', '--tail', '60', name)}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 600:
                raise SystemExit(f"no /health after 600 s:\n{docker('logs', '--tail', '60', name)}")
            time.sleep(1)
        log(f"/health answered 200 after {time.monotonic() - t0:.0f} s (--enforce-eager)")
        while (status := docker("inspect", "-f", "{{.State.Health.Status}}", name)) == "starting":
            time.sleep(2)
        log(f"Docker HEALTHCHECK: {status}")
        if status != "healthy":
            failures.append(f"HEALTHCHECK status {status}")

        eos = tokenizer.eos_token_id
        for prompt, expected in zip(COMPLETION_PROMPTS, completions, strict=True):
            body = {"model": "/model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "return_token_ids": True}  # fmt: skip
            code, response = post(f"{base}/v1/completions", body)
            got = response["choices"][0]["token_ids"] if code == 200 else None
            same = got == strip_eos(expected, eos)
            log(f"completion {prompt!r}: HTTP {code}, {'EQUAL' if same else 'DIFFERENT'} to HF greedy: "
                f"{tokenizer.decode(expected)!r}")  # fmt: skip
            if not same:
                failures.append(f"completion {prompt!r}: vLLM {got} vs HF {expected}")
        for messages, expected in zip(CHATS, chats, strict=True):
            body = {"model": "/model", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "return_token_ids": True}  # fmt: skip
            code, response = post(f"{base}/v1/chat/completions", body)
            choice = response["choices"][0] if code == 200 else {}
            got = choice.get("token_ids")
            text = choice.get("message", {}).get("content")
            expected_text = tokenizer.decode(expected, skip_special_tokens=True)
            same = got == strip_eos(expected, eos) if got is not None else text == expected_text
            log(f"chat {messages[-1]['content']!r}: HTTP {code}, {'EQUAL' if same else 'DIFFERENT'} to HF greedy "
                f"(compared {'token ids' if got is not None else 'text'}): {expected_text!r}")  # fmt: skip
            if not same:
                failures.append(f"chat {messages[-1]['content']!r}: vLLM {got or text!r} vs HF {expected}")

        for label, body in [
            ("malformed JSON", b"{not json"),
            ("max_tokens=-5", {"model": "/model", "prompt": "Hi", "max_tokens": -5}),
        ]:
            code, _ = post(f"{base}/v1/completions", body)
            ok, response = post(f"{base}/v1/completions", {"model": "/model", "prompt": "Hi", "max_tokens": 4,
                                                            "temperature": 0.0})  # fmt: skip
            keeps = ok == 200 and len(response["choices"][0]["text"]) > 0
            log(
                f"{label}: HTTP {code}; next request HTTP {ok} ({'still serving' if keeps else 'NOT serving'})"
            )
            if not (400 <= code < 500 and keeps):
                failures.append(f"{label}: HTTP {code}, then {ok}")
    finally:
        t0 = time.monotonic()
        docker("stop", "-t", "60", name, check=False)
        seconds = time.monotonic() - t0
        state = json.loads(docker("inspect", "-f", "{{json .State}}", name, check=False) or "{}")
        tail = docker("logs", "--tail", "8", name, check=False)
        with open(work / "serve-container.log", "w") as f:
            subprocess.run(["docker", "logs", name], stdout=f, stderr=subprocess.STDOUT, check=False)
        docker("rm", "-f", name, check=False)
    exit_code = state.get("ExitCode")
    clean = exit_code == 0 and seconds < 60 and not state.get("OOMKilled")
    log(f"docker stop: exited with {exit_code} after {seconds:.1f} s ({'clean' if clean else 'NOT clean'}); "
        f"last log lines:\n{tail}")  # fmt: skip
    if not clean:
        failures.append(f"docker stop: exit code {exit_code} after {seconds:.1f} s")
    log_text = (work / "serve-container.log").read_text()
    said = [line for line in log_text.splitlines() if "KV cache: " in line or "no API key" in line]
    log("the image's own choices, from its log: " + " | ".join(said))
    if log_text.count("no API key") != 1 or "KV cache: " not in log_text:
        failures.append(
            "the unauthenticated server did not say once that it is unauthenticated, or its KV size"
        )
    failures += check_api_key(work, checkpoint)
    if failures:
        raise SystemExit("serve check FAILED:\n  " + "\n  ".join(failures))
    log("serve: all checks passed")


def check_api_key(work: Path, checkpoint: Path) -> list[str]:
    """The image with a key file mounted as a secret: every route answers 401 without the key or with a wrong one
    (/invocations too, which vLLM's own check leaves open), 200 with it; /health and /ping stay open; the key is in
    neither the logs nor `docker inspect`."""
    key = "sk-swiftkv-" + os.urandom(12).hex()
    secret = work / "api-key"
    secret.write_text(key + "\n")
    # as docker/README.md: its owner and the image's group (gid 1000) read it; everyone where that is not ours to set
    with contextlib.suppress(PermissionError):
        os.chown(secret, -1, 1000)
    secret.chmod(0o640 if secret.stat().st_gid == 1000 else 0o644)
    port, failures = free_port(), []
    name = f"swiftkv-serve-auth-{port}"
    command = [
        "run", "-d", "--name", name, "--network", "host", "--shm-size", "1g", "-v", f"{checkpoint}:/model:ro",
        "-v", f"{secret}:/run/secrets/api-key:ro", "-e", "SWIFTKV_API_KEY_FILE=/run/secrets/api-key",
        SERVE_IMAGE, "/model", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
    ]  # fmt: skip
    log("docker " + " ".join(command))
    docker("rm", "-f", name, check=False)
    docker(*command)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while not healthy(base):
            if docker("inspect", "-f", "{{.State.Running}}", name) != "true" or time.monotonic() - t0 > 600:
                return [f"the authenticated server did not come up:\n{docker('logs', '--tail', '40', name)}"]
            time.sleep(1)
        body = {"model": "/model", "prompt": "Hi", "max_tokens": 2}
        routes = (("/v1/models", None), ("/v1/completions", body), ("/invocations", body),
                  ("/tokenize", {"model": "/model", "prompt": "Hi"}), ("/metrics", None))  # fmt: skip
        for path, payload in routes:
            codes = {who: status(base + path, payload, token) for who, token in
                     (("no key", None), ("wrong key", "wrong"), ("the key", key))}  # fmt: skip
            log(f"auth {path}: " + ", ".join(f"{who} HTTP {code}" for who, code in codes.items()))
            if codes != {"no key": 401, "wrong key": 401, "the key": 200}:
                failures.append(f"auth {path}: {codes}")
        for probe in ("/health", "/ping"):
            code = status(base + probe, None, None)
            log(f"auth {probe} without a key: HTTP {code}")
            if code != 200:
                failures.append(f"{probe} answered {code} without a key")
    finally:
        docker("stop", "-t", "60", name, check=False)
        logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True).stdout
        inspect = docker("inspect", name, check=False)
        docker("rm", "-f", name, check=False)
    leaks = [where for where, text in (("docker logs", logs), ("docker inspect", inspect)) if key in text]
    log(f"auth: the key appears in {leaks or 'neither the logs nor docker inspect'}")
    return failures + [f"the key leaks into {where}" for where in leaks]


def status(url: str, body: dict | None, token: str | None) -> int:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


# ---------------------------------------------------------------------------------------------------- training
QUICK_FIT = [
    "--trainer.max_steps", "3", "--trainer.max_time", "null", "--trainer.log_every_n_steps", "1",
    "--model.evaluate_before_training", "false", "--model.kv_init_tokens", "1024", "--model.schedule_seconds", "null",
    "--data.train_files", "[dataset:chat_prompts]", "--data.val_files", "[dataset:chat_prompts]",
    "--data.max_length", "64", "--data.batch_size", "2", "--data.max_train_rows", "32", "--data.max_val_rows", "4",
]  # fmt: skip


def load_export(export: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    import swiftkv_core  # noqa: F401

    transformers_logging.disable_progress_bar()  # one line per check in the log, not a "Loading weights" bar
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    config = model.config
    return (
        f"{type(model).__name__} (l={config.num_key_value_layers} of {config.num_hidden_layers}) greedy: "
        f"{tokenizer.decode(out[0, ids.shape[1] :])!r}"
    )


def mounted_folder(work: Path, name: str) -> Path:
    """An empty folder ``work/name`` for a container to write in: the images run as uid 1000, so it is made
    writable by every user (the README's `chmod a+rwx runs`)."""
    folder = work / name
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    return folder


def run_job(work: Path, label: str, job: list[str], extra: list[str] = (), env: list[str] = ()) -> Path:
    outputs = mounted_folder(work, f"train-{label}")
    root = f"outputs/{label}"
    command = [
        "run", "--rm", "--network", "host", "--shm-size", "1g",
        "-v", f"{outputs}:/workspace/outputs", "-v", "swiftkv-docker-test-cache:/cache", *env,
        TRAIN_IMAGE, *job, "--config", "configs/distill/smollm2-135m-cpu.yaml",  # options after the config win
        "--trainer.default_root_dir", root, *QUICK_FIT, *extra,
    ]  # fmt: skip
    log("docker " + " ".join(command))
    t0 = time.monotonic()
    with open(work / f"train-{label}.log", "w") as f:
        result = subprocess.run(["docker", *command], stdout=f, stderr=subprocess.STDOUT, check=False)
    seconds = time.monotonic() - t0
    if result.returncode != 0:
        raise SystemExit(f"{label}: the container exited with {result.returncode}:\n"
                         + (work / f"train-{label}.log").read_text()[-4000:])  # fmt: skip
    export = outputs / label / "export" / "hf-serving"
    if not (export / "config.json").is_file():
        found = sorted(str(p.relative_to(outputs)) for p in outputs.rglob("config.json"))
        raise SystemExit(f"{label}: no export at {export} (config.json files: {found})")
    log(f"{label}: container exited 0 after {seconds:.0f} s; export {export.relative_to(work)}")
    log(f"{label}: export loaded outside the container: {load_export(export)}")
    return export


def check_train(work: Path) -> None:
    docker("volume", "rm", "-f", "swiftkv-docker-test-cache", check=False)  # a fresh cache: the default model
    run_job(work, "fit", ["swiftkv-distill", "fit"])  # is materialised inside the container
    run_job(
        work, "fabric",
        ["fabric", "run", "--accelerator", "cpu", "--devices", "2", "apps/distill.py"],
        ["--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
         "--trainer.strategy.data_parallel_size", "2", "--trainer.strategy.tensor_parallel_size", "1"],
        env=["-e", "OMP_NUM_THREADS=1"],  # 2 processes on 2 cores
    )  # fmt: skip
    check_quickstart_offline(work)
    check_benchmark(work)
    docker("volume", "rm", "-f", "swiftkv-docker-test-cache", check=False)
    log("train: all checks passed")


def check_quickstart_offline(work: Path) -> None:
    """The main job inside the training image with no network at all (`--network none`), mounted as the README says
    (a results folder at /workspace/runs, the cache volume): the default model and the offline data sets are in the
    image. The first container is killed when the distillation stage starts; a second one, with the same command,
    reuses the stages the first recorded in the mounted folder and writes the report, readable by every user of
    the host. Short settings; the chat answers (a teacher's generation) are left out."""
    runs = mounted_folder(work, "train-quickstart-runs")
    name = "swiftkv-docker-test-quickstart"  # the first container, killed
    docker("rm", "-f", name, check=False)
    options = ["--network", "none", "-v", f"{runs}:/workspace/runs", "-v", "swiftkv-docker-test-cache:/cache"]
    command = [TRAIN_IMAGE, "swiftkv", "quickstart", "--budget_minutes", "1", "--serve", "false",
               "--train_files", "[dataset:brown_train]", "--heldout_chat_prompts", "", "--max_eval_rows", "4",
               "--prompt_lengths", "[64, 128]", "--eval_tasks", "[swiftkv_capitals]"]  # fmt: skip
    log(f"docker run {' '.join(options + command)}  (killed when the distillation starts, then run again)")
    t0 = time.monotonic()
    docker("run", "-d", "--name", name, *options, *command)
    running = ["inspect", "-f", "{{.State.Running}}", name]
    while DISTILL_STAGE not in (first := docker("logs", name)) and docker(*running) == "true":
        time.sleep(1)
    docker("kill", name, check=False)
    docker("rm", "-f", name, check=False)
    if DISTILL_STAGE not in first:
        raise SystemExit(
            f"quickstart offline: the first container ended before the distillation:\n{first[-4000:]}"
        )
    with open(work / "train-quickstart.log", "w") as f:
        result = subprocess.run(
            ["docker", "run", "--rm", *options, *command], stdout=f, stderr=subprocess.STDOUT
        )
    log_text = (work / "train-quickstart.log").read_text()
    reports = list(runs.glob("*/report.md"))
    reused = [line for line in log_text.splitlines() if "done earlier, reused" in line]
    tasks = len(reports) == 1 and "| swiftkv_capitals |" in reports[0].read_text()  # lm-eval's row, offline
    if result.returncode != 0 or len(reports) != 1 or len(reused) < 4 or not tasks:
        raise SystemExit(
            f"quickstart offline: exit {result.returncode}, reports {reports}, reused {reused}, task accuracy "
            f"{tasks}:\n{log_text[-4000:]}"
        )
    # written by the image's uid 1000: a host user of another uid must still read all of it
    private = [p for p in runs.rglob("*") if p.stat().st_mode & (0o005 if p.is_dir() else 0o004) == 0]
    if private:
        raise SystemExit(f"quickstart offline: unreadable to other users: {[str(p) for p in private[:10]]}")
    headline = [line for line in log_text.splitlines() if "on held-out text" in line or "tokens:" in line]
    log(
        f"quickstart offline: killed at the distillation, rerun reused {len(reused)} stages, report "
        f"{reports[0].relative_to(work)} in {time.monotonic() - t0:.0f} s in all; "
        + " | ".join(h.strip() for h in headline)
    )


def check_benchmark(work: Path) -> None:
    """``benchmarks/gpu.py`` inside the training image with no network, as a GPU user runs it (there with
    ``--gpus all`` and without ``--tiny``: the Llama-3.1-8B shape), its results written to a mounted folder."""
    out = mounted_folder(work, "train-benchmark")
    command = ["run", "--rm", "--network", "none", "-v", f"{out}:/workspace/runs",
               "-v", "swiftkv-docker-test-cache:/cache", TRAIN_IMAGE,
               "python", "benchmarks/gpu.py", "--tiny", "true", "--out", "runs/gpu-tiny"]  # fmt: skip
    log("docker " + " ".join(command))
    t0 = time.monotonic()
    (work / "train-benchmark.log").write_text(docker(*command))
    result = json.loads((out / "gpu-tiny.json").read_text())
    missing = [part for part in ("prefill", "decode", "kv_cache", "distill") if not result.get(part)]
    if missing or not (out / "gpu-tiny.md").is_file():
        raise SystemExit(f"benchmark: no {missing or 'markdown'} in {out}:\n{json.dumps(result)[:2000]}")
    ours = next(row for row in result["distill"] if row["setup"].startswith("ours"))
    log(
        f"benchmark: benchmarks/gpu.py --tiny in {time.monotonic() - t0:.0f} s on {result['device']}: prefill "
        f"{result['prefill'][0]['speedup_x']:.2f}x, distillation {ours['tokens_per_s']:,.0f} tokens/s"
    )


if __name__ == "__main__":
    what, work = sys.argv[1], Path(sys.argv[2]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    {"serve": check_serve, "train": check_train}[what](work)
