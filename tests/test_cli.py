"""The one ``swiftkv`` command table (the top package, swiftkv.cli)."""

import pytest


def test_one_command_table_reaches_every_entry_point(capsys):
    import importlib

    from swiftkv.cli import COMMANDS, main

    assert set(COMMANDS) == {
        "convert", "analyze", "generate", "flops", "distill", "serve", "quickstart", "prepare-data", "eval", "lm-eval"
    }  # fmt: skip
    for name, command in COMMANDS.items():
        module, function = command.target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and all(name in out for name in COMMANDS), out
    with pytest.raises(SystemExit, match="unknown command 'fit'"):
        main(["fit"])


def test_table_commands_run_through_their_own_parsers(capsys):
    from swiftkv.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["distill", "fit", "--help"])  # LightningCLI: the recipe's trainer and model options
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--trainer.max_steps" in out and "--model.num_key_value_layers" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--help"])  # jsonargparse, from the typed signature
    assert exit_info.value.code == 0
    assert "--num_key_value_layers" in capsys.readouterr().out


def test_a_command_whose_extra_is_not_installed_says_which_to_install(monkeypatch):
    """``swiftkv eval`` imports lm-eval only as it runs: without it, one line naming the extra, before any work."""
    import sys

    from swiftkv.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as where swiftkv[eval] is not installed
    for command in (["eval", "--model", "runs/x/distilled"], ["lm-eval", "--tasks", "list"]):
        with pytest.raises(
            SystemExit, match=r"needs lm_eval, not installed here \(pip install 'swiftkv\[eval\]'\)"
        ):
            main(command)


def test_a_list_option_takes_bare_values_and_jsonargparse_forms_pass_unchanged():
    from swiftkv.cli import bare_lists
    from swiftkv.quickstart import main as quickstart

    cases = {
        ("--train_files", "a.jsonl"): ["--train_files", '["a.jsonl"]'],
        ("--train_files", "a, b.jsonl", "c:d.jsonl", "--serve", "false"): [
            "--train_files", '["a, b.jsonl", "c:d.jsonl"]', "--serve", "false"
        ],
        ("--train_files=a.jsonl",): ["--train_files", '["a.jsonl"]'],
        ("--prompt_lengths", "256", "-1"): ["--prompt_lengths", "[256, -1]"],  # numbers unquoted, for the check
        ("--train_files", "[a.jsonl, b.jsonl]"): ["--train_files", "[a.jsonl, b.jsonl]"],
        ("--train_files=[a.jsonl]",): ["--train_files", "[a.jsonl]"],
        ("--train_files+", "a.jsonl"): ["--train_files+", "a.jsonl"],
        ("--heldout_text", "null"): ["--heldout_text", "null"],
        ("--train_files", "a.jsonl", "-h"): ["--train_files", '["a.jsonl"]', "-h"],
        ("--model", "a b", "--recipe", "r"): ["--model", "a b", "--recipe", "r"],  # not lists
        ("--force",): ["--force", "true"],  # a yes/no option alone: on
        ("--serve", "--force", "false"): ["--serve", "true", "--force", "false"],
        ("--force=true",): ["--force=true"],
    }  # fmt: skip
    for given, expected in cases.items():
        assert bare_lists(quickstart, list(given)) == expected, given
    with pytest.raises(ValueError, match=r"--heldout_text '' names nothing: give its values"):
        bare_lists(quickstart, ["--heldout_text", ""])
