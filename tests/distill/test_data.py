"""Data: record formats, chat template, packing boundaries (in the collator AND in the model), split, errors."""

import json
import shutil

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from swiftkv_distill import data
from swiftkv_distill.batches import collate, pack
from swiftkv_distill.build import build_swiftkv_model
from swiftkv_distill.data import DataError, encode_record, evenly_spaced, load_records, record_kind
from swiftkv_distill.datamodule import DistillDataModule
from tests.conftest import use_data_cache
from tests.distill.conftest import write_jsonl


def test_pack_and_collate_positions_and_labels():
    rows = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], max_length=4)
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert [r["segments"] for r in rows] == [[3, 1], [1, 3], [2]]
    batch = collate(rows, pad_id=0, pad_to=4)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 0, 1]]
    assert batch["labels"].tolist() == [[2, 3, -100, -100], [-100, 7, 8, -100], [10, -100, -100, -100]]
    assert batch["loss_mask"].tolist() == [[True] * 4, [True] * 4, [True, True, False, False]]
    # flash-attn's sequences of the flattened rows: 3 | 1 ; 1 | 3 ; 2 | the last row's padding
    assert batch["cu_seq_lens"].tolist() == [0, 3, 4, 5, 8, 10, 12] and batch["max_seq_len"] == 3


def test_packed_sequences_do_not_attend_to_each_other(tiny_model):
    """A packed row gives each sequence exactly the logits it gets alone (teacher and student passes)."""
    model = build_swiftkv_model(str(tiny_model), num_key_value_layers=2)
    seqs = [[5, 17, 300, 42, 9], [77, 1000, 3], [12, 13, 14, 15, 16, 17]]
    batch = collate(pack(seqs, max_length=16), pad_id=0, pad_to=16)
    for swiftkv in (False, True):
        model.swiftkv(swiftkv)
        with torch.no_grad():
            # use_cache=False as in training: with a cache transformers does not look for packed sequences
            packed = model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
            ).logits[0]
            start = 0
            for seq in seqs:
                alone = model(input_ids=torch.tensor([seq])).logits[0]
                torch.testing.assert_close(packed[start : start + len(seq)], alone, rtol=1e-4, atol=1e-5)
                start += len(seq)
            # and without the position ids the sequences DO mix (the check above is not vacuous)
            mixed = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
            assert not torch.allclose(mixed[5:8], packed[5:8], atol=1e-4)


def test_split_is_deterministic_and_disjoint():
    def split_indices(n, val_fraction, seed):
        flags = data.held_out(n, val_fraction, seed)
        return np.flatnonzero(~flags).tolist(), np.flatnonzero(flags).tolist()

    train, val = split_indices(100, 0.1, seed=3)
    assert (train, val) == split_indices(100, 0.1, seed=3)
    assert len(val) == 10 and not set(train) & set(val) and len(train) + len(val) == 100
    assert split_indices(100, 0.1, seed=4)[1] != val
    # the records held out since the first release: the first tenth of the seeded permutation
    order = torch.randperm(100, generator=torch.Generator().manual_seed(3)).tolist()
    assert val == sorted(order[:10])


def test_records_stream_a_chunk_at_a_time(tmp_path, monkeypatch):
    """A file's records come in order, a chunk of at most ``CHUNK`` at a time, a text file's blank lines left out;
    a ``RecordSet`` gives the flagged records of several files, in order."""
    monkeypatch.setattr(data, "CHUNK", 3)
    text = tmp_path / "lines.txt"
    text.write_text("a\n\nb\n c\n\n\nd\ne\n")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"q{i}"} for i in range(5)])
    files = [data.RecordFile(text, tmp_path / "arrow"), data.RecordFile(prompts, tmp_path / "arrow")]
    assert [len(f) for f in files] == [5, 5] and [f.kinds for f in files] == [{"text"}, {"prompt"}]
    chunks = list(files[0].chunks())
    assert max(map(len, chunks)) <= 3 and [r["text"] for c in chunks for r in c] == ["a", "b", " c", "d", "e"]
    # as datasets lists them whole, messages whose keys differ among them too (kept as JSON text by datasets)
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "system", "content": "s", "name": "x"}, {"role": "user", "content": "q"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ] * 2)  # fmt: skip
    for file in (text, prompts, chat):
        whole = datasets.load_dataset(
            data._BUILDERS[file.suffix], data_files=str(file), split="train"
        ).to_list()
        assert load_records([file]) == [r for r in whole if r.get("text") != ""]
    assert load_records([chat])[0]["messages"][0] == {"role": "system", "content": "s", "name": "x"}
    keep = np.zeros(10, bool)
    keep[[1, 4, 5, 9]] = True
    kept = [r for c in data.RecordSet(files, keep).chunks() for r in c]
    assert kept == [{"text": "b"}, {"text": "e"}, {"prompt": "q0"}, {"prompt": "q4"}]


def test_capped_validation_rows_cover_the_whole_held_out_set():
    rows = list(range(948))
    picked = evenly_spaced(rows, 40)
    assert len(picked) == len(set(picked)) == 40 and picked[0] == 0 and picked[-1] > 900
    assert max(b - a for a, b in zip(picked, picked[1:], strict=False)) <= 948 // 40 + 1
    assert evenly_spaced(rows[:30], 40) == rows[:30]


def test_formats_and_chat_template(tiny_model, text_file, chat_file):
    dm = DistillDataModule(
        str(tiny_model), [str(text_file), str(chat_file)], max_length=64, batch_size=2, val_fraction=0.2
    )
    dm.setup()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.decode(
        [t for rows in (dm.train_rows, dm.val_rows) for r in rows for t in r["input_ids"].tolist()]
    )
    assert "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n" in text  # prompt-only
    assert "<|im_start|>assistant\nHi!<|im_end|>" in text  # prompt + response
    assert "Water falling from clouds." in text and "The jury said" in text
    assert all(len(r["input_ids"]) == 64 for r in dm.train_rows[:-1])
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 64)


def test_chat_rows_distil_the_answer_tokens_only(tiny_model):
    """A chat row distils the positions that PREDICT the assistant's tokens: from the last token of the generation
    prompt ("assistant\\n") to the one before the end-of-turn's last token. Prompt, system and template positions
    are context only (a chat user never samples them)."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    record = {"prompt": "Say hi.", "response": "Hi there!"}
    ids, distilled = encode_record(record, tok)
    predicted = tok.decode([ids[t + 1] for t, flag in enumerate(distilled) if flag])
    assert predicted == "Hi there!<|im_end|>\n"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert ids[: len(prompt)] == prompt and distilled.index(True) == len(prompt) - 1
    assert encode_record(record, tok, chat_tokens="all")[1] == [True] * len(ids)
    # every assistant turn of a conversation, none of the user's
    turns = {"messages": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "One."},
                          {"role": "user", "content": "B?"}, {"role": "assistant", "content": "Two."}]}  # fmt: skip
    ids, distilled = encode_record(turns, tok)
    predicted = [tok.decode(ids[t + 1]) for t, flag in enumerate(distilled) if flag]
    assert "".join(predicted) == "One.<|im_end|>\nTwo.<|im_end|>\n" and "B" not in predicted
    # text and prompt-only records distil every position
    assert all(encode_record({"text": "Rain fell."}, tok)[1]) and all(encode_record({"prompt": "A?"}, tok)[1])
    # through packing and the collator: loss_mask = the distilled positions, token_mask = every real token
    rows = pack([ids, [5, 6, 7]], max_length=len(ids) + 3, distilled=[distilled, [True] * 3])
    batch = collate(rows, pad_id=0, pad_to=len(ids) + 5)
    assert batch["loss_mask"][0].tolist() == distilled + [True] * 3 + [False] * 2
    assert batch["token_mask"][0].tolist() == [True] * (len(ids) + 3) + [False] * 2


def test_named_validation_sets(tiny_model, text_file, chat_file):
    dm = DistillDataModule(
        str(tiny_model),
        [str(text_file)],
        val_files={"text": [str(text_file)], "chat": [str(chat_file)]},
        max_length=32,
        batch_size=2,
    )
    dm.setup()
    assert dm.val_set_names == ["text", "chat"] and dm.val_rows == dm.val_set_rows["text"]
    text, chat = dm.val_dataloader()
    chat_batch = next(iter(chat))
    # chat rows score fewer positions than they hold (the answers), text rows all of them
    assert chat_batch["loss_mask"].sum() < chat_batch["token_mask"].sum()
    assert next(iter(text))["loss_mask"].sum() == next(iter(text))["token_mask"].sum()
    with pytest.raises(DataError, match="chat_tokens"):
        DistillDataModule(str(tiny_model), [str(text_file)], chat_tokens="prompt")


def test_data_errors(tmp_path, tiny_model, text_file):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"title": "no usable field"}])
    for path, message in (
        (empty, "is empty"),
        (bad, "could not be read"),
        (wrong, "expected a 'messages'"),
        (tmp_path / "missing.jsonl", "does not exist"),
        (tmp_path / "x.csv", "does not exist"),
    ):
        with pytest.raises(DataError, match=message):
            load_records([path])
    with pytest.raises(DataError, match="exceeds the model's context"):
        DistillDataModule(str(tiny_model), [str(text_file)], max_length=100_000).setup()
    with pytest.raises(DataError, match="train_files is empty"):
        DistillDataModule(str(tiny_model), [])
    # refused on construction (each process, before any launch), saying where a relative name was looked for
    for train, val in (([str(tmp_path / "gone.jsonl")], None), ([str(text_file)], {"chat": ["gone.jsonl"]})):
        with pytest.raises(
            DataError, match=rf"gone.jsonl does not exist{'' if val is None else ' .read from'}"
        ):
            DistillDataModule(str(tiny_model), train, val_files=val)
    # chat records without an answer: nothing to distil (the loss would be 0, the export the untrained model)
    unanswered = write_jsonl(
        tmp_path / "unanswered.jsonl", [{"messages": [{"role": "user", "content": "Hi?"}]}] * 4
    )
    for val_files, name in (([], "training"), ([str(unanswered)], "validation")):
        train = [str(text_file)] if val_files else [str(unanswered)]
        with pytest.raises(DataError, match=f"The {name} data has no token to distil"):
            DistillDataModule(str(tiny_model), train, val_files=val_files, max_length=64).setup()
    every = DistillDataModule(str(tiny_model), [str(unanswered)], max_length=64, chat_tokens="all")
    every.setup()  # every token distilled, the prompt's too
    assert len(every.train_rows) and all(row["distilled"].all() for row in every.train_rows)


def test_kv_init_rows_are_as_many_on_every_process(tiny_model, text_file):
    """Under FSDP2 each K/V-initialisation forward is a collective: a process with a batch fewer than the others
    would leave them waiting for ever. Training rows fewer than the sample asked for are cut to a multiple of the
    processes, never given out unevenly."""
    from types import SimpleNamespace

    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=16, batch_size=1, max_train_rows=20)
    dm.setup()
    assert len(dm.train_rows) == 20
    counts = []
    for rank in range(8):
        dm.trainer = SimpleNamespace(world_size=8, global_rank=rank)
        counts.append(len(dm.kv_init_dataloader(10**6)))
    assert counts == [2] * 8  # 16 of the 20 rows (before: 3 on ranks 0-3, 2 on ranks 4-7)
    dm.trainer = SimpleNamespace(world_size=32, global_rank=0)
    with pytest.raises(DataError, match="20 training rows for 32 processes"):
        dm.kv_init_dataloader(
            10**6
        )  # before: no rows anywhere, a bare StopIteration after the fit's forwards


def test_chat_data_needs_a_chat_template(tmp_path, tiny_model, chat_file, text_file):
    import shutil

    no_template = tmp_path / "no-template"
    shutil.copytree(tiny_model, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (no_template / extra).unlink(missing_ok=True)
    with pytest.raises(DataError, match="no chat template"):
        DistillDataModule(str(no_template), [str(chat_file)], max_length=64).setup()
    plain = DistillDataModule(str(no_template), [str(text_file)], max_length=64)
    plain.setup()  # plain text still works
    assert len(plain.train_rows)


def test_teacher_answers_are_reproducible_chat_data(tiny_model, tmp_path, monkeypatch):
    """The teacher answers prompt records (seeded sampling: the same answers twice), the answers are bounded by
    max_new_tokens, and the file written by the `answer` command trains as chat-template data. The HF backend
    (the fallback where vLLM is not installed; vLLM's is tested in tests/serve/test_bench_answers.py)."""
    from swiftkv_distill.answers import teacher_answers
    from swiftkv_distill.corpora import main as corpora_main

    use_data_cache(monkeypatch, tmp_path / "data")

    prompts = [
        {"prompt": "What is rain?", "source": "t"},
        {"prompt": "Name a colour.", "source": "t"},
        {"x": 1},
    ]
    first = teacher_answers(
        prompts, str(tiny_model), max_new_tokens=6, batch_size=2, backend="hf", cache=False
    )
    assert first == teacher_answers(prompts, str(tiny_model), 6, batch_size=2, backend="hf", cache=False)
    # temperature 0: greedy, as vLLM reads it (HF's sampling refused it after loading the model)
    greedy = teacher_answers(
        prompts, str(tiny_model), 6, batch_size=2, temperature=0, backend="hf", cache=False
    )
    assert greedy == teacher_answers(
        prompts, str(tiny_model), 6, batch_size=1, temperature=0, backend="hf", cache=False
    )
    assert [r["prompt"] for r in first] == ["What is rain?", "Name a colour."]  # both answered, in order
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for record in first:
        # 6 new tokens at most (re-tokenising the decoded text may split it differently, hence the slack)
        assert record["source"] == "t" and 0 < len(tokenizer(record["response"])["input_ids"]) <= 12

    prompt_file = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    out = tmp_path / "answers.jsonl"
    corpora_main(["answer", "--prompts", str(prompt_file), "--out", str(out), "--model", str(tiny_model),
                  "--max_new_tokens", "6", "--batch_size", "2", "--backend", "hf"])  # fmt: skip
    written = load_records([str(out)])
    assert written == first and record_kind(written[0]) == "prompt_response"
    text = tokenizer.decode(encode_record(written[0], tokenizer)[0])  # the chat template around both turns
    assert "What is rain?" in text and written[0]["response"] in text and "assistant" in text


def test_answer_datasets_are_answered_by_the_data_modules_teacher(tiny_model, tmp_path, monkeypatch):
    """dataset:chat_answers is answered by the model the data module names (one generation for both splits, the
    held-out prompts never in the training split), and a SwiftKV checkpoint is refused with the way out."""
    from swiftkv_core.convert import convert, save_checkpoint
    from swiftkv_distill import answers, corpora

    use_data_cache(monkeypatch, tmp_path / "data")
    prompts = [{"prompt": f"Name {n} colours.", "source": "t"} for n in range(10)]
    monkeypatch.setattr(corpora, "chat_prompts", lambda: prompts)
    monkeypatch.setattr(
        answers, "answer_backend", lambda backend="auto": "hf"
    )  # the fast path for a tiny model
    dm = DistillDataModule(
        str(tiny_model),
        ["dataset:chat_answers"],
        val_files={"chat": ["dataset:chat_answers_heldout"]},
        max_length=64,
    )
    dm.setup()
    train, heldout = (load_records(corpora.resolve_files([f"dataset:{n}"], str(tiny_model)))
                      for n in ("chat_answers", "chat_answers_heldout"))  # fmt: skip
    assert (
        len(train) + len(heldout) <= 10
        and heldout
        and not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    )
    assert len(list((tmp_path / "data" / "teacher_answers").glob("*.jsonl"))) == 1  # one generation
    entry = {m: answers.teacher_answers_cache_file(prompts, m)[0] for m in (str(tiny_model), "default")}
    assert (
        entry[str(tiny_model)].is_file() and entry[str(tiny_model)] != entry["default"]
    )  # keyed by the teacher
    swiftkv = save_checkpoint(convert(str(tiny_model), 2), tmp_path / "swiftkv")
    with pytest.raises(ValueError, match="SwiftKV checkpoint.*prepare-data answer"):
        corpora.resolve_files(["dataset:chat_answers"], str(swiftkv))


def test_the_teachers_device_keys_its_answers(tiny_model, tmp_path, monkeypatch):
    """The HF teacher answers where it is told (the quickstart's --accelerator): on a machine with a GPU, answers
    asked of the CPU are keyed as on a machine without one (the same samples, the same file), those of the GPU
    apart (its samples and dtype differ); a device that is not there is refused before any weight is read."""
    from swiftkv_distill import answers, corpora

    use_data_cache(monkeypatch, tmp_path / "data")
    monkeypatch.setattr(answers, "answer_backend", lambda backend="auto": "hf")

    def answer_file(device: str):
        return corpora.dataset_path("chat_answers", str(tiny_model), device)

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is visible here"):
            answer_file("cuda")
    with pytest.raises(ValueError, match="choose 'auto'.*'cpu' or 'cuda'"):
        answer_file("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    on_a_cpu_machine = answer_file("auto")
    assert answer_file("cpu") == on_a_cpu_machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert answer_file("cpu") == on_a_cpu_machine
    assert answer_file("auto") == answer_file("cuda") != on_a_cpu_machine
    _, record = answers.teacher_answers_cache_file([], str(tiny_model), backend="hf", device="cuda")
    assert record["dtype"] == "bfloat16"


def test_a_teacher_whose_text_files_change_in_place_answers_anew(tiny_model, tmp_path, monkeypatch):
    """The cached answers are those of the teacher's weights and config, and of the files that decide its text: a
    chat template, tokenizer or generation config edited in the same folder keys answers of its own; a file that
    does not decide the text (a README) keeps the key."""
    from swiftkv_distill import answers

    use_data_cache(monkeypatch, tmp_path / "data")
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model, teacher)

    def key():
        return answers.teacher_answers_cache_file(
            [{"prompt": "hi"}], str(teacher), backend="hf", device="cpu"
        )[0]

    keys = [key()]
    (teacher / "README.md").write_text("the same teacher")
    assert key() == keys[0]
    tokenizer_config = json.loads((teacher / "tokenizer_config.json").read_text())
    for name, text in (
        ("chat_template.jinja", "{{ messages[0]['content'] }}"),
        ("tokenizer_config.json", json.dumps({**tokenizer_config, "model_max_length": 64})),
        ("generation_config.json", json.dumps({"eos_token_id": [0, 1]})),
    ):
        (teacher / name).write_text(text)
        keys.append(key())
    assert len(set(keys)) == len(keys)
    _, record = answers.teacher_answers_cache_file([], str(teacher), backend="hf", device="cpu")
    text_files = ["chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(record["text_files"]) == text_files


def test_answer_sets_are_kept_in_the_cache_not_an_images_data_folder(tiny_model, tmp_path, monkeypatch):
    """An image ships its data sets in ``$SWIFTKV_DATA_DIR``, outside its cache volume; the answer sets, made at run
    time, go to the cache beside their answers, which a rerun in a new container (resuming the main job) still has.
    """
    from swiftkv_distill import answers, corpora

    monkeypatch.setenv("SWIFTKV_DATA_DIR", str(tmp_path / "image-data"))
    monkeypatch.setenv("SWIFTKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(answers, "answer_backend", lambda backend="auto": "hf")
    assert corpora.dataset_path("brown_train") == tmp_path / "image-data" / "brown_train.jsonl"
    for name in ("chat_answers", "chat_answers_heldout"):
        path = corpora.dataset_path(name, str(tiny_model), "cpu")
        assert path.parent == tmp_path / "cache" / "data" / "distill" and path.name.startswith(name + "-")
