"""Prompt data: synthetic arithmetic, prompt files, tokenization, resumable prompt order."""

from __future__ import annotations

import argparse
import json
import operator
import re

import pytest

from megarl.data import (
    PromptStream,
    add_data_args,
    generate_arithmetic,
    load_prompts,
    run_data,
    tokenize_prompts,
    write_jsonl,
)
from megarl.data.datasets import load_records
from megarl.errors import ConfigError

# -- arithmetic ---------------------------------------------------------------------------------


def test_arithmetic_answers_are_the_correct_integers():
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    for record in generate_arithmetic(500, seed=3, digits=3):
        a, op, b = record["meta"]["expression"].split()
        expected = ops[op](int(a), int(b))
        assert record["answer"] == str(expected) and expected >= 0
        # The prompt asks about the same two numbers, in order, and for a boxed answer.
        assert re.findall(r"\d+", record["prompt"]) == [a, b], record["prompt"]
        assert record["prompt"].endswith("Put your final answer in \\boxed{}.")


def test_digits_knob_mixes_easy_and_hard_operands():
    operands = [
        int(x) for r in generate_arithmetic(500, seed=0, digits=3) for x in r["meta"]["expression"].split()[::2]
    ]
    assert max(operands) < 1000
    widths = {len(str(x)) for x in operands}
    assert widths == {1, 2, 3}
    assert (
        max(int(x) for r in generate_arithmetic(200, seed=0, digits=1) for x in r["meta"]["expression"].split()[::2])
        < 10
    )


def test_arithmetic_is_deterministic_per_seed_and_differs_across_seeds():
    assert generate_arithmetic(100, seed=7) == generate_arithmetic(100, seed=7)
    first = {r["prompt"] for r in generate_arithmetic(200, seed=1, digits=3)}
    second = {r["prompt"] for r in generate_arithmetic(200, seed=2, digits=3)}
    assert len(first & second) < 10


def test_arithmetic_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="--digits"):
        generate_arithmetic(5, digits=0)
    with pytest.raises(ConfigError, match="--n"):
        generate_arithmetic(0)


def test_data_cli_writes_jsonl_that_loads_back(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_data_args(parser)
    out = tmp_path / "sub" / "arith.jsonl"
    args = parser.parse_args(["--n", "20", "--seed", "4", "--digits", "2", "--out", str(out)])
    assert run_data(args) == 0
    assert "wrote 20" in capsys.readouterr().out
    expected = generate_arithmetic(20, seed=4, digits=2)
    loaded = load_prompts(out)
    assert [(r.plain_prompt, r.answer, r.meta) for r in loaded] == [
        (e["prompt"], e["answer"], e["meta"]) for e in expected
    ]
    assert loaded[0].messages == [{"role": "user", "content": expected[0]["prompt"]}]


# -- prompt files ------------------------------------------------------------------------------

CHAT = {
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}],
    "answer": "5",
    "meta": {"level": 1},
}
PLAIN = {"prompt": "What is 6 x 7?", "answer": 42, "id": "q2"}


def test_write_jsonl_round_trip(tmp_path):
    records = [CHAT, {"prompt": "Ünïcode \\boxed{} question", "answer": "\\frac{1}{2}"}]
    write_jsonl(records, tmp_path / "r.jsonl")
    assert [json.loads(line) for line in (tmp_path / "r.jsonl").read_text(encoding="utf-8").splitlines()] == records
    chat, plain = load_prompts(tmp_path / "r.jsonl")
    assert chat.messages == CHAT["messages"] and plain.answer == "\\frac{1}{2}"
    assert not (tmp_path / "r.jsonl.tmp").exists()


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_chat_and_plain_records_load(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(CHAT), "", json.dumps(PLAIN)])
    chat, plain = load_prompts(path)
    assert chat.messages == CHAT["messages"] and chat.answer == "5" and chat.meta == {"level": 1}
    assert chat.plain_prompt is None
    assert plain.messages == [{"role": "user", "content": "What is 6 x 7?"}]
    assert plain.answer == "42" and plain.meta == {"id": "q2"}  # extra fields join meta
    assert plain.source == f"{path}:3"


@pytest.mark.parametrize(
    "bad_line,message",
    [
        ('{"prompt": "hi"}', "missing field 'answer'"),
        ('{"answer": "1"}', "exactly one of the fields 'prompt' or 'messages'"),
        ('{"prompt": "hi", "answer": "1"', "not valid JSON"),
        ('{"messages": [{"content": "hi"}], "answer": "1"}', "messages[0] is missing field 'role'"),
        ('{"messages": [], "answer": "1"}', "'messages' must be a non-empty list"),
        ('["prompt", "answer"]', "must be a JSON object"),
        ('{"prompt": "hi", "answer": "1", "meta": 3}', "'meta' must be an object"),
    ],
)
def test_bad_record_names_file_line_and_field(tmp_path, bad_line, message):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(PLAIN), bad_line])
    with pytest.raises(ConfigError) as info:
        load_prompts(path)
    assert str(info.value).startswith(f"{path}:2: ")
    assert message in str(info.value)


def test_missing_empty_and_unknown_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(tmp_path / "none.jsonl")
    with pytest.raises(ConfigError, match="holds no records"):
        load_prompts(write_lines(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ConfigError, match=".jsonl or .parquet"):
        load_prompts(write_lines(tmp_path / "p.csv", ["prompt,answer"]))


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{**CHAT, "prompt": None}, {"prompt": "6 x 7?", "answer": "42", "messages": None, "meta": None}]
        ),
        path,
    )
    chat, plain = load_prompts(path)
    assert chat.messages == CHAT["messages"] and chat.answer == "5" and chat.meta["level"] == 1
    assert plain.plain_prompt == "6 x 7?" and plain.answer == "42"


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    import sys

    # pyarrow is a dependency; a machine without it must still get a clear message
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "p.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + ".*pip install pyarrow"):
        load_prompts(path)


# -- tokenization ------------------------------------------------------------------------------


def tiny_chat_tokenizer(words):
    """A whitespace word-level tokenizer with a ChatML-style template: fast and deterministic."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        w: i
        for i, w in enumerate(
            dict.fromkeys(["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", *words])
        )
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    return tokenizer, vocab


def test_tokenize_prompts_applies_the_chat_template_and_drops_overlong(tmp_path):
    long_prompt = " ".join(["word"] * 40)
    records = [{"prompt": "what is 2 + 3 ?", "answer": "5"}, CHAT, {"prompt": long_prompt, "answer": "0"}]
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in records])
    tokenizer, vocab = tiny_chat_tokenizer("what is 2 + 3 ? Be brief. 2 + 3? word".split())
    tokenized = tokenize_prompts(load_prompts(path), tokenizer, max_prompt_tokens=20)
    assert [t.record.answer for t in tokenized] == ["5", "5"]  # the 40-word prompt is dropped
    v = vocab
    assert tokenized[0].ids == [
        v["<|im_start|>"],
        v["user"],
        *(v[w] for w in "what is 2 + 3 ?".split()),
        v["<|im_end|>"],
        v["<|im_start|>"],
        v["assistant"],
    ]
    assert tokenized[1].ids == [
        v["<|im_start|>"],
        v["system"],
        v["Be"],
        v["brief."],
        v["<|im_end|>"],
        v["<|im_start|>"],
        v["user"],
        v["2"],
        v["+"],
        v["3?"],
        v["<|im_end|>"],
        v["<|im_start|>"],
        v["assistant"],
    ]
    with pytest.raises(ConfigError, match="max_prompt_tokens"):
        tokenize_prompts(load_prompts(path), tokenizer, max_prompt_tokens=3)


# -- prompt order ------------------------------------------------------------------------------


def test_prompt_stream_resume_equals_an_unbroken_stream():
    items = list(range(10))
    unbroken = PromptStream(items, seed=5).take(37)  # crosses three epoch boundaries

    first = PromptStream(items, seed=5)
    before = first.take(13)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptStream(items, seed=5)
    resumed.load_state_dict(state)
    assert before + resumed.take(24) == unbroken


def test_prompt_stream_epochs_are_seeded_permutations():
    stream = PromptStream(list(range(50)), seed=1)
    epoch0, epoch1 = stream.take(50), stream.take(50)
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1 and epoch0 != list(range(50))
    assert PromptStream(list(range(50)), seed=2).take(50) != epoch0
    assert PromptStream(list(range(5)), shuffle=False).take(7) == [0, 1, 2, 3, 4, 0, 1]


def test_prompt_stream_refuses_a_checkpoint_of_other_prompts_or_seed():
    state = PromptStream(list(range(10)), seed=0).state_dict()
    with pytest.raises(ConfigError, match="did the prompt file change"):
        PromptStream(list(range(11)), seed=0).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed 0"):
        PromptStream(list(range(10)), seed=1).load_state_dict(state)


def test_arithmetic_held_out_set_shares_no_problem_with_the_training_set():
    from megarl.data.arithmetic import arithmetic_records, generate_arithmetic

    def pairs(records):  # (operator, operands) read from the prompts' recorded expressions
        out = set()
        for r in records:
            a, op, b = r["meta"]["expression"].split()
            out.add((op, *sorted((int(a), int(b)))) if op in "+*" else (op, int(a), int(b)))
        return out

    train = pairs(generate_arithmetic(2000, 1))
    held_out = arithmetic_records("arithmetic:256:99:heldout:2000:1")  # the demo's
    assert len(held_out) == 256 and len(pairs(held_out)) == 256
    assert not pairs(held_out) & train
    # the demo's earlier held-out set (another seed only) shared problems with its training set
    assert len(pairs(generate_arithmetic(64, 99)) & train) > 0


def test_the_ood_arithmetic_set_shares_nothing_with_the_training_generator():
    """arithmetic-ood: every problem has a 3-digit operand, a negative operand or a negative result
    (the training generator, 1-2 digit operands and results >= 0, makes none), none of its wordings, never
    \\boxed; its answers are right; and the math reward reads each of its answer forms."""
    from megarl.data.arithmetic import _TEMPLATES, generate_arithmetic, problem_key
    from megarl.data.arithmetic_ood import INSTRUCTIONS, ood_records
    from megarl.rewards.math_verify_reward import math_reward

    ood = ood_records("arithmetic-ood:300:7")
    assert len(ood) == 300 and ood == ood_records("arithmetic-ood:300:7") != ood_records("arithmetic-ood:300:8")
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    train_keys = {problem_key(r) for r in generate_arithmetic(2000, seed=1)}
    # each training template as a pattern (its placeholders: anything)
    patterns = [re.compile(re.sub(r"\\\{\w+\\\}", ".+?", re.escape(t))) for ts in _TEMPLATES.values() for t in ts]
    for r in ood:
        a, op, b = r["meta"]["expression"].split()
        a, b = int(a), int(b)
        assert int(r["answer"]) == ops[op](a, b)
        assert max(a, b) >= 100 or min(a, b) < 0 or int(r["answer"]) < 0, r
        assert problem_key(r) not in train_keys
        assert "boxed" not in r["prompt"] and not r["prompt"].startswith("What is")
        assert not any(p.match(r["prompt"]) for p in patterns), r["prompt"]
    assert sum(int(r["answer"]) < 0 for r in ood) > 30 and {r["meta"]["expression"].split()[1] for r in ood} == set(ops)
    # every instruction is used, and each answer form it asks for is scored right (and a wrong one not)
    assert {i for i in INSTRUCTIONS if i} <= {i for r in ood for i in INSTRUCTIONS if i and i in r["prompt"]}
    for response in ("-39", "Final answer: -39", "81 - 120 = -39. So the temperature is -39 degrees."):
        assert math_reward(response, "-39") == 1.0, response
        assert math_reward(response.replace("-39", "39"), "-39") == 0.0, response
    with pytest.raises(ConfigError, match="arithmetic-ood:<n>:<seed>"):
        ood_records("arithmetic-ood:0:1")


def test_a_misspelled_built_in_spec_is_named_with_the_nearest_kind_not_called_a_missing_file():
    with pytest.raises(
        ConfigError,
        match=r"^arithmetc:10:1: neither a prompt file nor a built-in data spec .*did you mean arithmetic:\.\.\.\?",
    ):
        load_records("arithmetc:10:1")
    with pytest.raises(ConfigError, match=r"^nothing\.jsonl: prompt file does not exist$"):
        load_records("nothing.jsonl")  # a path without a spec's colon: still the missing file


def test_a_byte_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "b\xff", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}:2: not UTF-8 \(byte 0xff at column 14\)$"):
        load_records(str(bad))
