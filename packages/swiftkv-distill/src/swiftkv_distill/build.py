"""The model a distillation run trains and its step (checked from its config.json first, sized on the meta device
against the device's memory, then built once), and the training precision a CPU can run fast."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings

import torch

from swiftkv_core.checkpoints import check_checkpoint, model_identity, stored_dtype
from swiftkv_core.convert import SWIFTKV_FAMILIES, convert
from swiftkv_core.default_model import resolve_model_path
from swiftkv_core.early_exit import EarlyExitHead
from swiftkv_core.runtime import DTYPES, device_description, device_memory_bytes, gpu_computes_bf16
from swiftkv_core.weights import cast_frozen, train_only_swiftkv

from .console import OutOfMemory


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX): there ``bf16-mixed`` training runs
    its matmuls several times faster than fp32; elsewhere bf16 is emulated and slower than fp32."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes: assume the common case, no native bf16
        return False


def cpu_precision(precision: str) -> str:
    """The training precision to use on this CPU for a recipe's ``precision``: a bf16 one where the CPU has no
    native bf16 becomes ``32-true`` (the same numbers to within rounding, at the faster speed there)."""
    return "32-true" if str(precision).startswith("bf16") and not cpu_has_fast_bf16() else str(precision)


def warn_if_bf16_emulated(device: torch.device, precision: str) -> None:
    if device.type == "cpu" and cpu_precision(precision) != precision:
        warnings.warn(
            f"trainer.precision={precision} on a CPU without native bf16 (AVX512-BF16 or AMX): bf16 is emulated "
            "here and slower than fp32; set --trainer.precision 32-true.",
            stacklevel=2,
        )


def trainer_precision(trainer) -> str:
    """The Lightning trainer's precision (``bf16-mixed``, ``32-true``...); ``32-true`` without a trainer."""
    return str(trainer.precision) if trainer is not None else "32-true"


def check_precision(device: torch.device, trainer) -> None:
    """A bf16 precision on a GPU that computes bf16 (compute capability 8.0 or more): on a V100 or T4 autocast would
    emulate it, slowly, or fail mid-run. Raised before any weight is read."""
    precision = trainer_precision(trainer)
    if device.type != "cuda" or not precision.startswith("bf16"):
        return
    if not gpu_computes_bf16(device):
        # Lightning's ModelParallelStrategy (FSDP2) takes no 16-mixed
        sharded = type(getattr(trainer, "strategy", None)).__name__ == "ModelParallelStrategy"
        instead = "32-true (fp32)" if sharded else "16-mixed (fp16 autocast, fp32 master weights)"
        raise ValueError(
            f"trainer.precision {precision}: {device_description(device)} has no bf16 (compute capability below "
            f"8.0). Set trainer.precision: {instead}, or run on an A100, L4, H100 or newer GPU."
        )


ATTENTION = ("auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def attention_for(device: torch.device | str, requested: str = "auto", half: bool = True) -> str:
    """The attention implementation a run uses on ``device``. ``auto``: on a GPU flash-attn's where it is installed
    (variable-length kernels: packed sequences attend only within themselves) and the training steps compute in
    fp16 or bf16 (``half``; flash-attn computes in nothing else): FlashAttention-3 on a Hopper GPU (H100, H200) where
    its ``flash-attn-3`` package is installed, else flash-attn 2; else PyTorch's ``flex_attention`` (a block mask
    built from the packed segments: the blocks across sequences are skipped); on a CPU ``sdpa`` (fastest there;
    packed sequences get a dense mask). Each also runs in compiled layers (``compile_layers``). Asked for by name,
    flash-attn in fp32 is refused, saying what to set."""
    if requested not in ATTENTION:
        raise ValueError(f"attn_implementation must be one of {ATTENTION}, got {requested!r}.")
    if requested.startswith("flash_attention") and not half:
        raise ValueError(
            f"attn_implementation: {requested} computes in fp16 and bf16 only, and this run's training steps "
            "compute in fp32: set trainer.precision: bf16-mixed (fp32 weights, bf16 compute), or "
            "model.attn_implementation: flex_attention (or auto) to train in fp32."
        )
    if requested != "auto":
        return requested
    if torch.device(device).type != "cuda":
        return "sdpa"
    if not half:
        return "flex_attention"
    major = _compute_capability(device)
    if major < 8:  # flash-attn runs on Ampere (8.x) and newer only: not on a V100 or T4 in fp16
        return "flex_attention"
    if importlib.util.find_spec("flash_attn_interface") is not None and major == 9:
        from transformers.utils import is_flash_attn_3_available

        # transformers' own test: the package named flash-attn-3 (Hopper only)
        if is_flash_attn_3_available():
            return "flash_attention_3"
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "flex_attention"


def _compute_capability(device) -> int:
    """The major CUDA compute capability of ``device`` (the current GPU where it has no index): 9 on Hopper."""
    index = torch.device(device).index
    return torch.cuda.get_device_capability(torch.cuda.current_device() if index is None else index)[0]


def check_frozen_dtype(frozen: str, trainer) -> None:
    """Frozen weights in another dtype than the trained ones need autocast (a mixed precision); FSDP2 shards them
    as they are (its all-gathers carry bytes, its reduce-scatters only the trained ones' fp32 gradients)."""
    precision = trainer_precision(trainer)
    if not precision.endswith("-mixed"):
        raise ValueError(
            f"frozen_dtype={frozen} needs a mixed precision (trainer.precision bf16-mixed), got {precision}: "
            f"set trainer.precision: bf16-mixed, or drop model.frozen_dtype."
        )


def check_activation_checkpointing(every_n_layers: int) -> None:
    if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 0:
        raise ValueError(
            f"activation_checkpointing must be an integer >= 0 (0: off, 1: every layer, n: every n-th), got "
            f"{every_n_layers!r}."
        )


def checkpoint_activations(model, every_n_layers: int) -> None:
    """Activation checkpointing (HF's gradient checkpointing, non-reentrant) of every ``every_n_layers``-th decoder
    layer (0: none, switched off where it was on): a layer run with a graph keeps only its input and recomputes the
    rest in the backward pass. In a distillation step only the student's layers >= l run with a graph: per token and
    layer >= l, its activations less (a layer's input kept instead) for one more forward of it."""
    check_activation_checkpointing(every_n_layers)
    if every_n_layers:
        model.gradient_checkpointing_enable({"use_reentrant": False}, every_n_layers=every_n_layers)
        # HF makes the embeddings' output require grad, for reentrant checkpoints; without it the layers < l keep
        # running without a graph (nothing there trains; non-reentrant checkpoints need no such input)
        model.disable_input_require_grads()
    elif model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()


def compile_layers(model, enabled: bool = True) -> None:
    """``torch.compile`` each decoder layer (regional compilation, as torchtitan does): the norms, RoPE, the MLP's
    activation and the casts around them fuse into a few kernels. One compile serves every layer alike; a handful
    of variants in all (a layer < l, the teacher's and the student's layers >= l, with and without a graph).
    Weights and state-dict names stay as they are. A layer already compiled is left as it is (a second fit of the
    same module reuses its compiled code). Compiling needs a C++ compiler on a CPU, Triton on a GPU.

    With flex_attention, each layer's attention module runs outside its graph (one graph break per layer, the
    norms, residuals and MLP compiled): lowered inside the layers' graphs it gave a loss 17% off on an H100; outside
    them the eager step's loss and gradients on an H200 (``SwiftKVAttentionMixin.flex_outside_compiled_graph``)."""
    if not enabled:
        return
    # each variant is a recompile of the one layer forward: room for all of them, never a silent eager fallback
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    for layer in model.model.layers:
        layer.self_attn.flex_outside_compiled_graph = True
        if layer._compiled_call_impl is None:  # nn.Module.compile()'s wrapper, set once
            layer.compile()


# what a resumed run may change: how fast or in how much memory it runs, and what it validates on (the same training)
RESUMABLE_CHANGES = {"evaluate_before_training", "reshard_after_forward", "attn_implementation", "compile_layers",
                     "activation_checkpointing", "logits_chunk_size", "num_workers", "val_batch_size", "val_files",
                     "max_val_rows"}  # fmt: skip


def check_same_run(checkpoint: dict, module_settings: dict, datamodule=None, trainer=None) -> None:
    """Refuse to resume from ``checkpoint`` with settings that change the training: the restored optimizer and
    schedule would go on with the old ones while the run reported the new ones. Names each change and the way out.
    ``datamodule``: the run's ``DistillDataModule`` (or None), its settings and its ``state_dict`` (the processes and
    accumulated batches, which the checkpoint's position in the data and the schedule's length count in), for
    ``trainer`` where it is not yet attached to it (``recipe.check_resume``)."""
    changed = []
    # the model the frozen weights are read from, found by its content (check_same_model, after the settings):
    # the same model in another folder (copied to a node's disk) is the same run, and so the data's tokenizer there
    found = "model_identity" in checkpoint
    data = datamodule.hparams if datamodule else {}
    same = found and _comparable(data.get("model")) == _comparable(module_settings["model"])
    data_state = checkpoint.get(type(datamodule).__qualname__, {}) if datamodule is not None else {}
    for prefix, saved, now, moved in (
        ("model", checkpoint.get("hyper_parameters", {}), module_settings, {"model"} if found else set()),
        ("data", checkpoint.get("datamodule_hyper_parameters", {}), data, {"model"} if same else set()),
        ("trainer", data_state, datamodule.state_dict(trainer) if datamodule else {}, set()),
    ):
        for key in sorted((saved.keys() & now.keys()) - RESUMABLE_CHANGES - moved):
            if _comparable(saved[key]) == _comparable(now[key]):
                continue
            if key == "training_rows_sha256":
                if saved.get("training_rows") == now.get("training_rows"):  # another count is named already
                    changed.append(
                        f"the training rows' tokens (sha256 {saved[key][:12]}... -> {now[key][:12]}...: a data "
                        "file, a dataset:NAME set made again, the model's tokenizer or the tokenizing libraries "
                        "changed them; restore the data and tokenizer the run started with to continue it)"
                    )
                continue
            name = "the data files' training_rows" if key == "training_rows" else f"{prefix}.{key}"
            changed.append(f"{name} {saved[key]!r} -> {now[key]!r}")
    if changed:
        raise ValueError(
            f"the checkpoint to resume from was written with other settings ({'; '.join(changed)}): run with its "
            "settings to continue it, or start a new run in another folder (distill fit: "
            "--trainer.default_root_dir; the main job: --out, or --force to start over)."
        )
    if found:
        check_same_model(checkpoint["model_identity"], module_settings["model"])


def check_same_model(saved: dict, model: str) -> None:
    """Refuse ``model`` where its config or weight files are not those of ``saved``, the ``model_identity`` of the
    model a checkpoint was trained from: the checkpoint holds the trained weights alone, and a resume or an export
    reads the frozen ones from ``model``, which would then be another model's."""
    now = model_identity(resolve_model_path(model))
    differ = ["its config.json differs"] if now["config_sha256"] != saved["config_sha256"] else []
    before, after = saved["weight_files"], now["weight_files"]
    for name in sorted(before.keys() | after.keys()):
        if before.get(name) != after.get(name):
            differ.append(
                f"{name} {'is missing' if name not in after else 'is new' if name not in before else 'differs'}"
            )
    if differ:
        trained_from = "" if saved["path"] == now["path"] else f" ({saved['path']})"
        raise ValueError(
            f"{now['path']} is not the model the checkpoint was trained from{trained_from}: "
            f"{', '.join(differ[:4])}. The checkpoint holds the trained weights alone, and the frozen ones are read "
            "from the model: give --model.model the model the run started from (another folder holding the same "
            "files will do), or start a new run in another folder."
        )


def _comparable(value) -> str:
    """A setting as JSON (a tuple equals its list), each existing path resolved (``runs/x`` equals ``/abs/runs/x``)."""
    if isinstance(value, (str, os.PathLike)):
        value = os.fspath(value)
        return json.dumps(os.path.realpath(value) if os.path.exists(value) else value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_comparable(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{" + ",".join(f"{json.dumps(str(k))}:{_comparable(v)}" for k, v in sorted(value.items())) + "}"
        )
    return json.dumps(value, default=str)


KV_INITS = ("least_squares", "published")
KV_INIT_WEIGHTINGS = ("attention", "uniform")


def check_kv_init(kv_init: str, tokens: int, ridge: float, weighting: str) -> None:
    """The K/V initialisation's settings (``model.kv_init*``), checked before any weight is loaded."""
    if kv_init not in KV_INITS:
        raise ValueError(f"kv_init must be one of {KV_INITS}, got {kv_init!r}.")
    if weighting not in KV_INIT_WEIGHTINGS:
        raise ValueError(f"kv_init_weighting must be one of {KV_INIT_WEIGHTINGS}, got {weighting!r}.")
    if tokens < 1 or not ridge >= 0:  # (not NaN either)
        raise ValueError(f"kv_init_tokens must be >= 1 and kv_init_ridge >= 0, got {tokens} and {ridge}.")


def check_lora(lora_rank: int, lora_prefix: bool) -> None:
    """The adapters' settings (``model.lora_rank`` / ``model.lora_prefix``), checked before any weight is loaded."""
    if not isinstance(lora_rank, int) or isinstance(lora_rank, bool) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an integer >= 0 (0: Q/K/V only), got {lora_rank!r}.")
    if lora_prefix and not lora_rank:
        raise ValueError("lora_prefix=True needs lora_rank > 0 (the adapters' rank).")


def build_swiftkv_model(
    model: str,
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    lora_rank: int = 0,
    lora_prefix: bool = False,
    weights: bool = True,
):
    """A SwiftKV model ready to distil: converted from a base checkpoint, or a SwiftKV checkpoint loaded as is;
    attention through ``attn_implementation`` (one of ``ATTENTION`` but ``auto``); with ``lora_rank > 0`` and
    adapters (swiftkv_core.modeling.LowRankAdapter) on o_proj and the MLP of layers ``>= l`` (``lora_prefix``: and
    on the MLP of layers ``< l``). ``weights=False``: built from the config alone, none read (under
    ``torch.device("meta")``: the run's sizes, ``check_fits``)."""
    from transformers import AutoModelForCausalLM

    check_lora(lora_rank, lora_prefix)
    path, config = check_checkpoint(model, num_key_value_layers, key_value_group_size)
    if weights:
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        loaded = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if config.model_type in SWIFTKV_FAMILIES:
        built = train_only_swiftkv(loaded).swiftkv(True)
    else:
        built = convert(loaded, num_key_value_layers, key_value_group_size)
    has = built.config.lora_rank, built.config.lora_prefix
    if lora_rank and has[0] and has != (lora_rank, lora_prefix):
        raise ValueError(
            f"{model} has adapters of rank {has[0]} (lora_prefix={has[1]}), but lora_rank={lora_rank} "
            f"(lora_prefix={lora_prefix}) was asked for: set model.lora_rank: {has[0]} and model.lora_prefix: "
            f"{str(has[1]).lower()} to continue training them."
        )
    if lora_rank and not has[0]:
        train_only_swiftkv(built.add_lora(lora_rank, lora_prefix))
    built.config._attn_implementation = attn_implementation
    return built


def run_device(trainer) -> torch.device:
    """The device a run computes on: its trainer's (none: ``load_from_checkpoint``'s CPU)."""
    return trainer.strategy.root_device if trainer is not None else torch.device("cpu")


def sized_step(run, trainer):
    """``run``'s step (a ``SwiftKVDistillation``'s) on the meta device, refused where ``trainer``'s device cannot
    compute or hold it: before a weight is read, and on one process before the data is tokenised
    (``DistillCLI.fit``)."""
    check_precision(device := run_device(trainer), trainer)
    with torch.device("meta"):
        sized = distillation_step(run.hparams, device, trainer, run.loss_settings, weights=False)
    check_fits(device, sized, run, trainer)
    return sized


def distillation_step(hp, device: torch.device, trainer, settings, weights: bool = True):
    """A fresh, unsharded ``DistillationStep`` of a run's settings ``hp`` (``SwiftKVDistillation``'s hyperparameters)
    on ``device``, under ``trainer`` (or None), with the loss ``settings``: the frozen base weights in
    ``frozen_dtype``, the SwiftKV ones initialised, the early-exit head. ``weights=False``: from the config alone
    (``build_swiftkv_model``)."""
    from .step import DistillationStep

    precision = trainer_precision(trainer)
    half = precision.startswith(("bf16", "16")) or hp.model_dtype in ("bfloat16", "float16")
    attention = attention_for(device, hp.attn_implementation, half)
    trained, frozen = DTYPES[hp.model_dtype], DTYPES[hp.frozen_dtype or hp.model_dtype]
    if frozen != trained and trainer is not None:  # without one (load_from_checkpoint): an export, no step
        check_frozen_dtype(hp.frozen_dtype, trainer)
    # A checkpoint stored in the frozen dtype (Llama's bf16) is read in it, and only the trained weights widened, in
    # half the host memory (70B: 141 GB, not 282 GB): the values of reading it all in fp32, but for those computed
    # as the model is built (AcrossKV's group means, LoRA's random start), computed in bf16
    load = frozen if frozen != trained and weights and stored_dtype(hp.model) == frozen else trained
    model = build_swiftkv_model(hp.model, hp.num_key_value_layers, hp.key_value_group_size, load, attention,
                                hp.lora_rank, hp.lora_prefix, weights)  # fmt: skip
    model.train()  # dropout is 0 in these families; train() only matters for the module flags
    checkpoint_activations(model, hp.activation_checkpointing)
    # the early-exit head trains: a copy of the LM head made before the frozen weights' cast
    head = EarlyExitHead.from_model(model) if hp.early_exit else None
    step = DistillationStep(model, settings, head)
    return cast_frozen(step, frozen, trained)


def resident_bytes(module: torch.nn.Module) -> int:
    """The bytes a run holds on its device from its first step to its last, before any activation: each frozen
    weight, and each trained parameter with its gradient and AdamW's two moments (four of its size). ``module``
    may be built on the meta device (sizes without weights)."""
    return sum(p.numel() * p.element_size() * (4 if p.requires_grad else 1) for p in module.parameters())


def check_kv_fit_fits(
    device: torch.device, module: torch.nn.Module, hp, shards: int, copies: int, total: int
) -> None:
    """The least-squares K/V fit runs before training: the weights (no gradient or optimizer state yet) and the
    fit's float64 normal equations (``KVLeastSquares.statistics_bytes``, whole on every process) must fit, ``copies``
    times where that many processes share the memory."""
    if hp.kv_init != "least_squares":
        return
    from swiftkv_core.kv_init import KVLeastSquares

    weights = sum(p.numel() * p.element_size() for p in module.parameters()) / shards
    fit = KVLeastSquares(module.model, weighting=hp.kv_init_weighting).statistics_bytes()
    if copies * (weights + fit) <= total:
        return
    changes = ["model.kv_init: published (the published initialisation, no fit)"]
    if hp.kv_init_weighting != "uniform":
        uniform = KVLeastSquares(module.model, weighting="uniform").statistics_bytes()
        changes.insert(0, f"model.kv_init_weighting: uniform ({uniform / 2**30:.1f} GiB)")
    changes += _fewer_processes(copies, weights + fit, total)
    raise OutOfMemory(
        f"{hp.model}'s least-squares K/V fit ({hp.kv_init_weighting} weighting) holds {fit / 2**30:.1f} GiB of "
        f"float64 normal equations on every process, beside {weights / 2**30:.1f} GiB of weights"
        f"{_sharing(copies, weights + fit)}: more than the {total / 2**30:.1f} GiB of "
        f"{device_description(device)}. To fit: " + "; or ".join(changes) + "."
    )


def _sharing(copies: int, each: float) -> str:
    """What ``copies`` processes sharing one machine's memory, ``each`` bytes each, add to a refusal."""
    if copies == 1:
        return ""
    return f", and {copies} processes share this machine's memory ({copies * each / 2**30:.1f} GiB together)"


def _fewer_processes(copies: int, each: float, total: int) -> list[str]:
    """The change to suggest where fewer of the ``copies`` processes sharing a machine, ``each`` bytes each, fit."""
    fit = int(total // each)
    return (
        [f"{fit} process{'es' * (fit > 1)} on this machine, not {copies} (trainer.devices)"]
        if 0 < fit < copies
        else []
    )


def check_fits(device: torch.device, module: torch.nn.Module, run, trainer=None) -> None:
    """Refuse a run whose ``resident_bytes`` alone (per process: FSDP2 shards them over the processes) exceed
    ``device``'s memory: it could not take one step; or whose least-squares K/V fit would not fit beside its
    weights (every process holds the fit's normal equations whole). A GPU is one process's; a CPU's memory is
    shared by the processes ``trainer`` runs on this machine (``trainer.num_devices``), each holding its share.
    ``run``: the ``SwiftKVDistillation`` (its hyperparameters, the source model's config, its FSDP2 mesh, the
    checkpoint it resumes from: a run that resumes, or starts from a SwiftKV checkpoint, fits nothing). Raised
    before any weight is read (``module`` built on the meta device), as ``console.OutOfMemory`` with what would
    fit."""
    total = device_memory_bytes(device)
    shards = trainer.world_size if trainer is not None and run.device_mesh is not None else 1
    copies = trainer.num_devices if trainer is not None and device.type == "cpu" else 1
    need = resident_bytes(module)
    if total is None:
        return
    if copies * need / shards <= total:
        if run.resume_from is None and run.model_config.model_type not in SWIFTKV_FAMILIES:
            check_kv_fit_fits(device, module, run.hparams, shards, copies, total)
        return
    model = run.hparams.model
    frozen = [p for p in module.parameters() if not p.requires_grad]
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in frozen})
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    changes = []
    if any(p.dtype == torch.float32 for p in frozen):
        changes.append(
            "model.frozen_dtype: bfloat16 with trainer.precision: bf16-mixed (halves the frozen weights)"
        )
    if device.type == "cuda":
        gpus = -(-need // total)
        changes.append(
            f"{gpus} or more GPUs with FSDP2 (llama-3.1-8b-instruct.yaml's strategy), which shards them"
        )
    else:
        if shards == 1:  # processes each holding the whole model (DDP), not a shard of it
            changes += _fewer_processes(copies, need, total)
        changes.append("a machine with more memory, or a GPU")
    raise OutOfMemory(
        f"{model} does not fit the {total / 2**30:.1f} GiB of {device_description(device)}: its frozen weights "
        f"({sum(p.numel() * p.element_size() for p in frozen) / 2**30:.1f} GiB in {', '.join(dtypes)}) and its "
        f"{trained / 1e6:,.0f}M trained parameters with their gradients and AdamW state need "
        f"{need / shards / 2**30:.1f} GiB{' per process' * (shards > 1 or copies > 1)} before any activation"
        f"{_sharing(copies, need / shards)}. To fit: " + "; or ".join(changes) + "."
    )
