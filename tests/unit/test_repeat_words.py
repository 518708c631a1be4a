"""The learning bench's repeat-a-word task: its held-out part shares no (word, count) pair with any
training prompt, its answers are what the reward scores 1, its words are one token each, and the warm
start's teacher miscounts by at most its jitter."""

import pytest

from megarl.data import repeat_words
from megarl.data.datasets import load_records
from megarl.errors import ConfigError
from megarl.rewards.registry import resolve_reward
from tests.conftest import ROOT


def _pairs(records):
    return {(r["meta"]["word"], r["meta"]["count"]) for r in records}


def test_no_held_out_or_validation_pair_is_asked_by_any_other_part_whatever_the_seeds():
    heldout = repeat_words.repeat_records("repeat:128:0:heldout")
    validation = repeat_words.repeat_records("repeat:64:0:validation")
    assert len(_pairs(heldout)) == 128  # every held-out pair once (32 words x 20 counts / 5)
    assert len(_pairs(validation)) == 64  # every validation pair once (/ 10)
    assert not _pairs(heldout) & _pairs(validation)
    for seed in (0, 1, 2, 99):
        train = repeat_words.repeat_records(f"repeat:4000:{seed}")
        assert not _pairs(train) & _pairs(heldout)
        assert not _pairs(train) & _pairs(validation)
        assert not _pairs(train) & _pairs(repeat_words.repeat_records(f"repeat:50:{seed}:heldout"))
        assert not _pairs(train) & _pairs(repeat_words.repeat_records(f"repeat:30:{seed}:validation"))
    # 4000 draws reach every one of the 448 training pairs: the three parts cover the 640 pairs
    assert len(_pairs(repeat_words.repeat_records("repeat:4000:3"))) == 640 - 128 - 64
    # every word and every count is trained with other partners
    train = _pairs(repeat_words.repeat_records("repeat:4000:1"))
    assert {w for w, _ in train} == set(repeat_words.WORDS)
    assert {c for _, c in train} == set(range(1, repeat_words.MAX_COUNT + 1))


def test_records_ask_for_a_word_a_number_of_times_and_the_answer_is_that_many_lines():
    (r,) = repeat_words.repeat_records("repeat:1:7")
    word, count = r["meta"]["word"], r["meta"]["count"]
    assert r["prompt"].endswith(f"\n{word}") and f" {count} " in f" {r['prompt']} "
    assert r["answer"] == "\n".join([word] * count)
    # the same spec gives the same records; load_records parses them as any data spec's
    assert repeat_words.repeat_records("repeat:5:7") == repeat_words.repeat_records("repeat:5:7")
    loaded = load_records("repeat:5:7")
    assert [x.answer for x in loaded] == [x["answer"] for x in repeat_words.repeat_records("repeat:5:7")]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("repeat:5", "expected repeat:<n>:<seed>"),
        ("repeat:5:1:test", "expected repeat:<n>:<seed>"),
        ("repeat:5:1:train", "expected repeat:<n>:<seed>"),
        ("repeat:0:1", "n must be >= 1"),
        ("repeat:129:0:heldout", "the heldout part has 128"),
        ("repeat:65:0:validation", "the validation part has 64"),
    ],
)
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        repeat_words.repeat_records(spec)


def test_each_word_and_the_newline_are_one_token_of_smollm2s_tokenizer():
    from tokenizers import Tokenizer

    from megarl.model_source import _smollm2_tokenizer

    tok = Tokenizer.from_file(str(_smollm2_tokenizer(ROOT / "runs" / "cache") / "tokenizer.json"))
    for word in repeat_words.WORDS:
        ids = tok.encode("\n".join([word] * 3)).ids
        assert len(ids) == 5 and ids[0] == ids[2] == ids[4] and ids[1] == ids[3], word
        # the prompt's last token is the answer's word: writing it is copying
        assert tok.encode(f"Repeat the word below 3 times, each on its own line.\n{word}").ids[-1] == ids[0]


def test_the_reward_by_hand():
    reward = resolve_reward("repeat")
    answer = "fox\nfox\nfox\nfox"  # count 4
    assert reward("fox\nfox\nfox\nfox", answer) == 1.0
    assert reward("fox fox  fox\nfox ", answer) == 1.0  # whitespace separates words, whatever it is
    assert reward("fox\nfox\nfox", answer) == pytest.approx(0.5 * (1 - 1 / 4))  # one short
    assert reward("fox\nfox\nfox\nfox\nfox\nfox", answer) == pytest.approx(0.5 * (1 - 2 / 4))  # two long
    assert reward("fox\nfox\ncat\nfox", answer) == pytest.approx(0.5 * (1 - (1 + 1) / 4))  # a hit short, an other
    assert reward("cat\ncat\ncat\ncat", answer) == 0.0  # (4 + 4) / 4 off: floored at 0
    assert reward("", answer) == 0.0
    assert reward("fox\n" * 9, answer) == 0.0  # 5 too many of 4


def test_the_warm_start_teacher_miscounts_by_at_most_a_sixth_and_only_on_training_pairs():
    demos = repeat_words.warm_start_records(2000, 1)
    records = repeat_words.repeat_records("repeat:2000:1")
    assert [d["prompt"] for d in demos] == [r["prompt"] for r in records]
    exact, off = 0, {}
    for d, r in zip(demos, records):
        word, count = r["meta"]["word"], r["meta"]["count"]
        written = d["response"].split("\n")
        assert set(written) == {word}
        assert abs(len(written) - count) <= repeat_words.jitter(count) and len(written) >= 1
        exact += len(written) == count
        off[count] = off.get(count, set()) | {len(written) - count}
    assert [repeat_words.jitter(c) for c in (1, 2, 3, 8, 9, 14, 15, 20)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert off[20] == {-3, -2, -1, 0, 1, 2, 3} and off[1] == {0}  # the teacher's spread grows with the count
    assert 0.2 < exact / len(demos) < 0.5
