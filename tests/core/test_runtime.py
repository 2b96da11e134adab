"""Timers are right on a GPU: every reading of the clock waits for the device first (kernels run asynchronously:
a timer that does not wait measures their launch). On this CPU the check is that each timer synchronises the
device of the work it times, around that work; on a GPU, that its figure matches CUDA events."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from swiftkv_core import runtime
from swiftkv_core.convert import convert
from swiftkv_core.generation import time_prefill
from tests.conftest import tiny_base


@pytest.fixture
def events(monkeypatch):
    """What happens, in order: each synchronisation (with its device), each reading of the timers' clock and each
    model forward."""
    log = []
    real = runtime.synchronize

    def synchronize(device):
        log.append(("synchronize", torch.device(device).type))
        real(device)

    def perf_counter():
        log.append(("clock", None))
        return time.perf_counter()

    monkeypatch.setattr(runtime, "synchronize", synchronize)
    monkeypatch.setattr(runtime, "time", SimpleNamespace(perf_counter=perf_counter))
    return log


WAIT_THEN_READ = [("synchronize", "cpu"), ("clock", None)]


def test_prefill_timer_waits_for_the_device_before_each_reading(events):
    model = convert(tiny_base("llama"), 2)
    model.register_forward_pre_hook(lambda *_: events.append(("forward", None)))
    time_prefill(model, torch.randint(1, 128, (1, 16)), repeats=2, warmup=1)
    # per prefill: wait, then read the clock; the forward; wait, then read the clock
    assert events == (WAIT_THEN_READ + [("forward", None)] + WAIT_THEN_READ) * 3


def test_stopwatch_measures_the_work_between_start_and_stop(events):
    seconds = runtime.timed(lambda: time.sleep(0.05), "cpu")
    assert seconds >= 0.05  # the sleep was inside (no ceiling: a loaded machine may take longer)
    assert events == WAIT_THEN_READ * 2
    with pytest.raises(RuntimeError, match="before start"):
        runtime.Stopwatch("cpu").stop()


@pytest.mark.gpu
def test_prefill_timer_matches_cuda_events_on_a_gpu():
    """A timer that did not synchronise would read the launch time only: far below the CUDA events' figure."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("cuda"):
        config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=16,
                             num_key_value_heads=4, vocab_size=32000)  # fmt: skip
        model = convert(LlamaForCausalLM(config).to(torch.bfloat16), 4)
    ids = torch.randint(1, 32000, (1, 4096), device="cuda")
    measured = time_prefill(model, ids, repeats=3, warmup=1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        start.record()
        model(ids, use_cache=True, logits_to_keep=1)
        end.record()
    torch.cuda.synchronize()
    events_s = start.elapsed_time(end) / 1000
    assert 0.7 * events_s < measured < 1.5 * events_s, (measured, events_s)


@pytest.mark.gpu
def test_stopwatch_waits_for_work_queued_before_and_inside_it_on_a_gpu():
    """``torch.cuda._sleep`` queues a kernel that spins on the GPU and returns at once: a timer that did not wait at
    its end would read ~0 for it, and one that did not wait at its start would count earlier queued work."""
    cycles = 50_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    kernel_s = start.elapsed_time(end) / 1000
    assert kernel_s > 0.005, kernel_s  # the check below needs a kernel far longer than a launch
    assert runtime.timed(lambda: torch.cuda._sleep(cycles), "cuda") >= 0.9 * kernel_s
    torch.cuda._sleep(cycles)  # queued before the timer starts: not its work
    assert runtime.timed(lambda: None, "cuda") < 0.1 * kernel_s


MIB = 2**20


def test_peak_memory_counts_what_the_work_holds_at_once_on_a_cpu():
    resident = torch.empty(MIB, dtype=torch.uint8)
    with runtime.PeakMemory("cpu", resident=[resident, resident[:10]]) as meter:  # a view counted once
        a = torch.ones(4 * MIB, dtype=torch.uint8)
        del a  # freed: the next allocation reuses its place in the count
        b = torch.ones(2 * MIB, dtype=torch.uint8)
        view, inplace = b[: MIB // 2], b.add_(1)  # neither allocates
        c = torch.ones(MIB, dtype=torch.uint8)
    assert meter.peak_bytes == MIB + 4 * MIB  # resident + the 4 MiB alone (2 + 1 MiB later held at once < 4)
    with runtime.PeakMemory("cpu") as meter:
        d = torch.ones(3 * MIB, dtype=torch.uint8)
        e = d.float()  # a new storage of 12 MiB, beside d's 3
    assert meter.peak_bytes == 15 * MIB
    assert view.numel() and inplace is b and c.numel() and e.numel()


def test_peak_memory_sees_the_tensors_saved_for_backward():
    """A 3-layer MLP's forward keeps both hidden ReLU outputs for the backward pass; without a graph each is
    freed once the next layer has read it."""
    layers = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 256)
    x = torch.randn(512, 256)
    act = 512 * 1024 * 4  # one fp32 (512, 1024) activation

    def forward():
        return layers[2](torch.relu(layers[1](torch.relu(layers[0](x))))).sum()

    with runtime.PeakMemory("cpu") as graph:
        loss = forward()
    with torch.no_grad(), runtime.PeakMemory("cpu") as no_graph:
        forward()
    assert graph.peak_bytes >= 3 * act  # relu 1's output (saved) + layer 2's output + relu 2's
    assert no_graph.peak_bytes < 2 * act + act // 2  # layer 2's output + relu 2's, at most
    loss.backward()


@pytest.mark.gpu
def test_peak_memory_on_a_gpu_is_the_allocators():
    x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    with runtime.PeakMemory("cuda") as meter:
        y = torch.ones(32 * MIB, dtype=torch.uint8, device="cuda")
    assert meter.resident_bytes >= x.numel() and meter.peak_bytes >= x.numel() + y.numel()


def test_device_and_dtype_choice(monkeypatch):
    """``--device`` / ``--dtype`` of the commands: auto takes the GPU where one is visible, in bf16 (fp16 on a GPU
    without bf16: a V100, a T4); the CPU in fp32."""
    gpu = torch.cuda.is_available()
    assert runtime.choose_device("auto").type == ("cuda" if gpu else "cpu")
    assert runtime.choose_device("cpu") == torch.device("cpu")
    assert runtime.choose_dtype("auto", torch.device("cpu")) == torch.float32
    # a host with a T4 (7.5: no bf16) as GPU 0 and an A100 (8.0) as GPU 1: each GPU's own answer counts
    capabilities = {0: (7, 5), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_capability",
        lambda device=None: capabilities[getattr(device, "index", None) or 0],
    )
    assert runtime.choose_dtype("auto", torch.device("cuda")) == torch.float16
    assert runtime.choose_dtype("auto", torch.device("cuda:0")) == torch.float16
    assert runtime.choose_dtype("auto", torch.device("cuda:1")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert runtime.choose_dtype("float16", torch.device("cpu")) == torch.float16
    for bad in ("gpu", "tpu", "mps", "cuda:x"):
        with pytest.raises(ValueError, match=f"--device '{bad}': choose 'auto'"):
            runtime.choose_device(bad)
    with pytest.raises(ValueError, match="--dtype 'fp8': choose 'auto' or one of"):
        runtime.choose_dtype("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="no CUDA GPU is visible" if not gpu else "numbered from 0"):
        runtime.choose_device("cuda:64")


@pytest.mark.gpu
def test_work_put_on_the_auto_device_goes_to_the_current_device_on_a_gpu():
    """``current_device``: a run on the last GPU (``--trainer.devices [N]``) prepares its data there, where the
    ``auto`` device puts the teacher's answers; a CPU run's context changes nothing."""
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    with runtime.current_device(last):
        assert torch.zeros(1, device=runtime.choose_device("auto")).device == last
    with runtime.current_device("cpu"):
        assert torch.cuda.current_device() == 0 and torch.zeros(1).device.type == "cpu"
