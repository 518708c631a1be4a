"""The tools demo's parts on SmolLM2's own tokenizer: warm-start records are training problems (none
held out) rendered by `megarl sft` into exactly the ids an RL episode of rollout.tools holds, prompts
describe the tools in training and evaluation alike, and an episode is scored on its final turn."""

import json
from pathlib import Path

import pytest

from megarl.config import RolloutConfig, load_config
from megarl.data.arithmetic import arithmetic_records
from megarl.data.arithmetic_ood import ood_records
from megarl.data.datasets import load_records, tokenize_prompts
from megarl.environments.factory import chatml_format, prompt_renderer
from megarl.environments.tool import parse_tool_calls
from megarl.errors import ConfigError
from megarl.executors.reward import RewardExecutor, final_turn_ids
from megarl.generator.interface import Completion
from megarl.loop.sft import sft_examples
from megarl.rewards.math_verify_reward import math_reward
from megarl.tools_demo import calculator_sft_records

TINY = "configs/tiny_cpu.yaml"
HELDOUT, OOD = "arithmetic:256:99:heldout:2000:1", "arithmetic-ood:200:7"


@pytest.fixture(scope="module")
def tok():
    from megarl.generator.tokenizer import load_tokenizer
    from megarl.model_source import _smollm2_tokenizer

    return load_tokenizer(_smollm2_tokenizer(Path(load_config(TINY).model.cache_dir)))


def _tools_rollout():
    return RolloutConfig(tools=["calculator"], max_turns=3)


def test_records_are_training_problems_and_none_is_held_out():
    records = calculator_sft_records("arithmetic:2000:1", 64, 0)
    train = {r["prompt"] for r in arithmetic_records("arithmetic:2000:1")}
    held = {r["prompt"] for r in arithmetic_records(HELDOUT)} | {r["prompt"] for r in ood_records(OOD)}
    prompts = [r["messages"][0]["content"] for r in records]
    assert len(set(prompts)) == 64 and set(prompts) <= train and not set(prompts) & held
    for r in records:
        (call,) = parse_tool_calls(r["messages"][1]["content"])
        a, op, b = call.arguments["expression"].split()
        # an independent check of the tool turn: the arithmetic of the call's own operands
        assert r["messages"][2]["content"] == str(
            {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        )
        assert r["messages"][2]["content"] == r["answer"]
    assert calculator_sft_records("arithmetic:2000:1", 64, 1) != records  # --seed picks other problems


def test_sft_record_ids_are_an_rl_episodes_ids(tmp_path, tok):
    record = calculator_sft_records("arithmetic:2000:1", 1, 0)[0]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (example,) = sft_examples(path, tok, 1024)
    user, call, result, final = (m["content"] for m in record["messages"])
    # the episode as rollout.tools builds it: the rendered prompt, the sampled call ending in the stop
    # token, the ChatML tool turn the environment inserts, the sampled final answer
    prompt = prompt_renderer(_tools_rollout(), tok)([{"role": "user", "content": user}])
    turn1 = tok.encode(call + "<|im_end|>", add_special_tokens=False)
    inserted = chatml_format(tok).tool_response_ids(turn1, [result])
    turn2 = tok.encode(final + "<|im_end|>", add_special_tokens=False)
    assert example.prompt_ids == prompt
    assert example.response_ids[:-1] == turn1 + inserted + turn2  # then the template's trailing newline
    assert tok.decode(example.response_ids[-1:]) == "\n"
    # both assistant turns trained (with the newline the template writes after each), the tool turn not
    n1 = len(turn1) + 1
    assert example.response_mask == [1] * n1 + [0] * (len(inserted) - 1) + [1] * (len(turn2) + 1)


def test_a_two_turn_record_trains_both_assistant_turns_and_refuses_bad_tools(tmp_path, tok):
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]  # fmt: skip
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"messages": chat}) + "\n" + json.dumps({"messages": chat, "tools": "calculator"}) + "\n"
    )
    with pytest.raises(ConfigError, match=r"d.jsonl:2: 'tools' is a list of function schemas"):
        sft_examples(path, tok, 512)
    path.write_text(json.dumps({"messages": chat}) + "\n")
    (e,) = sft_examples(path, tok, 512)
    trained = tok.decode([i for i, m in zip(e.response_ids, e.response_mask) if m])
    untrained = tok.decode([i for i, m in zip(e.response_ids, e.response_mask) if not m])
    assert trained == "4<|im_end|>\n6<|im_end|>\n"
    assert untrained == "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"


def test_prompts_describe_the_tools_in_training_and_evaluation(tok):
    records = load_records("arithmetic:4:1")
    plain = tokenize_prompts(records, tok, 512)
    tools = tokenize_prompts(records, tok, 512, prompt_renderer(_tools_rollout(), tok))
    for p, t in zip(plain, tools):
        text = tok.decode(t.ids)
        assert '"name": "calculator"' in text and "<tool_call>" in text and "<|im_start|>system\n# Tools" in text
        # the question and the generation prompt unchanged after the tools' system message
        assert tok.decode(p.ids).split("<|im_start|>user")[1] == text.split("<|im_start|>user")[1]
    assert prompt_renderer(RolloutConfig(), tok) is None  # no tools: the plain chat template


def _episode(tok, turns):
    """A completion of generated (mask 1) and inserted (mask 0) text segments."""
    ids, mask = [], []
    for text, m in turns:
        seg = tok.encode(text, add_special_tokens=False)
        ids, mask = ids + seg, mask + [m] * len(seg)
    return Completion("r", 0, 0, [1], ids, [0.0] * len(ids), [0] * len(ids), "stop", meta={"answer": "84"},
                      loss_mask=mask)  # fmt: skip


def test_an_episode_is_scored_on_its_final_turn_not_the_tools_output(tok):
    # the calculator's right result in the transcript; a final turn that states no answer, and one that does
    silent = _episode(tok, [("<tool_call>{}</tool_call>", 1), ("<tool_response>\n84\n</tool_response>", 0),
                            ("Done.", 1)])  # fmt: skip
    right = _episode(tok, [("<tool_call>{}</tool_call>", 1), ("<tool_response>\n84\n</tool_response>", 0),
                           ("12 * 7 = \\boxed{84}", 1)])  # fmt: skip
    assert tok.decode(final_turn_ids(silent.output_ids, silent.loss_mask)) == "Done."
    assert final_turn_ids([5, 6], []) == [5, 6]  # a one-turn sample: all of it
    episodes = ["rollout.tools=[calculator]", "rollout.max_turns=3"]
    final = RewardExecutor(load_config(TINY, episodes + ["reward.scored_text=final_turn"]), tok)
    whole = RewardExecutor(load_config(TINY, episodes), tok)
    # the texts the executor hands the reward function (its worker process is not started in a unit test)
    assert [math_reward(final.decode(c, scored=True), "84") for c in (silent, right)] == [0.0, 1.0]
    assert final.decode(silent) == whole.decode(silent)  # rollouts.jsonl keeps the whole episode's text
    # scored whole, the math reward's last-number fallback grades the tool's output as the answer
    assert [math_reward(whole.decode(c, scored=True), "84") for c in (silent, right)] == [1.0, 1.0]


def test_final_turn_scoring_without_episodes_is_refused():
    with pytest.raises(ConfigError, match=r"reward.scored_text: final_turn scores an episode's last turn"):
        load_config(TINY, ["reward.scored_text=final_turn"])
    with pytest.raises(ConfigError, match=r"reward.scored_text"):
        load_config(TINY, ["reward.scored_text=last"])


@pytest.mark.parametrize(
    "tools,max_turns,message",
    [
        (("calc",), 3, r"--tools: no tool 'calc'"),
        ((), 3, r"--max-turns: > 1 needs --tools"),
        (("calculator",), 1, r"--max-turns: --tools needs >= 2"),
        ((), 0, r"--max-turns: must be >= 1"),
    ],
)
def test_eval_tool_flags_are_refused_naming_the_flag(tools, max_turns, message):
    from megarl.evaluate import _episode_settings

    with pytest.raises(ConfigError, match=message):
        _episode_settings(tools, max_turns)
