"""`megarl sft`'s records and steps: the response split off exactly, bad records named by line, every
record once per epoch, and the sft loss refused for RL."""

import json
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.loop.sft import sft_examples, sft_steps

TINY = "configs/tiny_cpu.yaml"


@pytest.fixture(scope="module")
def tok():
    from megarl.generator.tokenizer import load_tokenizer
    from megarl.model_source import _smollm2_tokenizer

    return load_tokenizer(_smollm2_tokenizer(Path(load_config(TINY).model.cache_dir)))


def _write(tmp_path, records):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_prompt_and_response_ids(tmp_path, tok):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]  # fmt: skip
    path = _write(tmp_path, [{"prompt": "2+2?", "response": "4"}, {"messages": chat}])
    plain, with_system = sft_examples(path, tok, 512)
    assert tok.decode(plain.response_ids) == "4<|im_end|>\n"
    assert tok.decode(plain.prompt_ids).endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(with_system.prompt_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert with_system.response_ids == plain.response_ids and with_system.source.endswith(":2")


@pytest.mark.parametrize(
    "record,message",
    [
        ("{not json", r"d.jsonl:2: not JSON"),
        ({"prompt": "x"}, r"d.jsonl:2: needs 'messages', or 'prompt' and 'response'"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]},
            r"d.jsonl:2: the last message is the trained one and must be the assistant's",
        ),  # fmt: skip
        ({"messages": [{"role": "assistant", "content": "x"}]}, r"d.jsonl:2: 'messages' needs the prompt"),
        ({"prompt": "word " * 300, "response": "x"}, r"d.jsonl:2: \d+ tokens, more than trainer.max_tokens"),
    ],
)
def test_bad_records_are_named_by_line(tmp_path, tok, record, message):
    path = _write(tmp_path, [{"prompt": "a", "response": "b"}, record])
    with pytest.raises(ConfigError, match=message):
        sft_examples(path, tok, 256)


def test_each_epoch_is_a_permutation_in_batches():
    steps = sft_steps(10, 4, 3, seed=1)
    assert [len(s) for s in steps] == [4, 4, 2] * 3
    for epoch in range(3):
        assert sorted(i for s in steps[3 * epoch : 3 * epoch + 3] for i in s) == list(range(10))
    assert steps[:3] != steps[3:6]  # reshuffled
    with pytest.raises(ConfigError, match="--batch-size and --epochs must be >= 1"):
        sft_steps(10, 0, 1, seed=1)


def test_rl_training_refuses_the_sft_loss():
    from megarl.train import train

    with pytest.raises(ConfigError, match="trainer.loss: 'sft' is megarl sft's loss"):
        train(TINY, ["trainer.loss=sft"])
