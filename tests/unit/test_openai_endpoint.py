"""The OpenAI-compatible endpoint (rollout.agent): the `openai` client runs tool-calling agent loops
against it, and the recorded trajectory is exactly the sampled ids and the ids of the messages the
agent added, rendered alone (written out by hand here from the chat template's text); the sampler's
log-probs and versions come back in the responses; sampling fields that would change the behaviour
policy are refused by name; an edited history, a turn limit and a failing agent end the episode,
counted, and the agent's thread with it."""

import json
import threading
from pathlib import Path

import openai
import pytest

from megarl.environments.agent_env import AgentTask, agent_environments
from megarl.environments.calculator import Calculator
from megarl.environments.episode import EpisodeSettings
from megarl.environments.multi_turn import MultiTurnBackend
from megarl.environments.openai_endpoint import Sampling
from megarl.generator.interface import Completion, GenerationRequest, GeneratorBackend, SamplingParams
from megarl.rollout import episode_metrics

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                               "parameters": {"type": "object"}}}  # fmt: skip
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call><|im_end|>'
ANSWER_TEXT = "The answer is 84.<|im_end|>"
SYSTEM = "Use the calculator for arithmetic."
QUESTION = [{"role": "user", "content": "What is 12 times 7?"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from megarl.model_source import _smollm2_tokenizer

    return AutoTokenizer.from_pretrained(_smollm2_tokenizer(ROOT / "runs" / "cache"))


class ScriptedBackend(GeneratorBackend):
    """Answers the k-th turn of every episode with texts[k] (encoded by the tokenizer); log-prob of
    token j of turn k is -0.01 (j + 1) - k; the version is 1 + the turn (an update between turns)."""

    def __init__(self, tokenizer, texts):
        self.ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        self.pending, self.prompts = [], []

    def submit(self, requests):
        self.pending += requests

    def step(self):
        out = []
        for r in self.pending:
            k = min(int(r.request_id.split("/turn")[1]), len(self.ids) - 1)
            self.prompts.append(list(r.prompt_ids))
            ids = self.ids[k][: r.params.max_new_tokens]
            finish = "stop" if len(ids) == len(self.ids[k]) else "length"
            logprobs = [-0.01 * (j + 1) - k for j in range(len(ids))]
            out.append(Completion(r.request_id, 0, r.group_id, list(r.prompt_ids), ids, logprobs, [1 + k] * len(ids),
                                  finish))  # fmt: skip
        self.pending = []
        return out

    def abort(self, request_ids):
        pass

    def update_weights(self, apply):
        return apply()

    def stats(self):
        return {}


def run_episode(tokenizer, agent_path, texts, max_turns=4, env_timeout_s=20.0, temperature=1.0):
    from megarl.generator.tokenizer import encode_prompt, stop_ids

    backend = ScriptedBackend(tokenizer, texts)
    make_env, endpoint = agent_environments(agent_path, tokenizer, stop_ids(tokenizer),
                                            Sampling(temperature, 1.0), env_timeout_s + 5)  # fmt: skip
    episodes = MultiTurnBackend(backend, make_env, lambda ids: tokenizer.decode(ids), keep_trajectories=True,
                                settings=EpisodeSettings(max_turns=max_turns, env_timeout_s=env_timeout_s),
                                on_close=[endpoint.close])  # fmt: skip
    prompt = encode_prompt(tokenizer, QUESTION)
    meta = {"answer": "84", "messages": QUESTION}
    episodes.submit([GenerationRequest("g0", prompt, SamplingParams(max_new_tokens=64), group_id=0, meta=meta)])
    [c] = episodes.run_until_idle()
    t = episodes.trajectory_of(c)
    episodes.close()
    return t, c, backend, episodes


SEEN = {}  # what the agents saw, by test


def calculator_agent(task: AgentTask):
    """A plain OpenAI tool-calling loop, as an agent program would write it."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}] + task.messages
    responses = SEEN.setdefault("calculator", [])
    for _ in range(4):
        r = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR], logprobs=True)
        responses.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump())  # as the client gives it back: refusal, annotations, ...
        if not msg.tool_calls:
            return
        for call in msg.tool_calls:
            result = Calculator()(json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def test_a_tool_calling_agent_records_exactly_the_sampled_and_inserted_ids(tokenizer):
    SEEN.clear()
    t, c, backend, episodes = run_episode(tokenizer, "tests.unit.test_openai_endpoint:calculator_agent",
                                          [CALL_TEXT, ANSWER_TEXT])  # fmt: skip

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    # SmolLM2's template has no tools section and no tool role: megarl's tools system text, and the
    # tool result in a user turn of <tool_response> blocks, as the calculator environment writes it
    system = SYSTEM + "\n\n# Tools\n\nYou can call the functions below."
    prompt_text = tokenizer.decode(t.prompt_ids)
    assert prompt_text.startswith("<|im_start|>system\n" + system) and '"name": "calculator"' in prompt_text
    assert prompt_text.endswith("<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n")
    glue = "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    want = t.prompt_ids + ids(CALL_TEXT) + ids(glue) + ids(ANSWER_TEXT)
    assert t.context() == want and t.finish == "done" and t.turns == 2
    assert backend.prompts == [t.prompt_ids, want[: len(want) - len(ids(ANSWER_TEXT))]]  # each turn's context

    sample = t.to_sample()
    sample.validate()
    n0, n1 = len(ids(CALL_TEXT)), len(ids(glue))
    assert sample.loss_mask == [1] * n0 + [0] * n1 + [1] * len(ids(ANSWER_TEXT))
    assert sample.trained(sample.policy_versions) == [1] * n0 + [2] * len(ids(ANSWER_TEXT))

    # what the client got: the parsed tool call, the sampler's log-probs and megarl's record
    r0, r1 = SEEN["calculator"]
    call = r0.choices[0].message.tool_calls[0]
    assert r0.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12 * 7"} and r0.choices[0].message.content is None
    assert [x.logprob for x in r0.choices[0].logprobs.content] == [-0.01 * (j + 1) for j in range(n0)]
    assert r0.model_extra["megarl"]["token_ids"] == ids(CALL_TEXT)
    assert r1.choices[0].message.content == "The answer is 84." and r1.choices[0].finish_reason == "stop"
    assert r1.model_extra["megarl"]["policy_versions"] == [2] * len(ids(ANSWER_TEXT))
    assert r1.usage.prompt_tokens == len(want) - len(ids(ANSWER_TEXT))


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\nTOOLS {{ tools | length }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_tools_and_a_tool_role_renders_them_itself(tokenizer):
    import copy

    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = QWEN_LIKE
    SEEN.clear()
    t, *_ = run_episode(qwen, "tests.unit.test_openai_endpoint:calculator_agent", [CALL_TEXT, ANSWER_TEXT])
    prompt = f"<|im_start|>system\nTOOLS 1<|im_end|>\n<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    prompt += "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n"
    glue = "\n<|im_start|>user\n<tool_response>84</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(t.prompt_ids) == prompt
    assert t.context() == t.prompt_ids + [
        i for text in (CALL_TEXT, glue, ANSWER_TEXT) for i in tokenizer.encode(text, add_special_tokens=False)
    ]


def editing_agent(task: AgentTask):
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages = list(task.messages)
    r = client.chat.completions.create(model=task.model, messages=messages, tools=[CALCULATOR])
    messages.append(r.choices[0].message.model_dump())
    messages.append({"role": "tool", "tool_call_id": "x", "content": "84"})
    messages[0] = {"role": "user", "content": "What is 12 times 8?"}  # rewrites the question
    try:
        client.chat.completions.create(model=task.model, messages=messages)
    except openai.APIStatusError as exc:
        SEEN["edited"] = exc
        raise


def test_an_edited_history_ends_the_trajectory_and_is_counted(tokenizer):
    SEEN.clear()
    t, c, _, episodes = run_episode(tokenizer, "tests.unit.test_openai_endpoint:editing_agent",
                                    [CALL_TEXT, ANSWER_TEXT])  # fmt: skip
    assert t.finish == "history_edited" and t.turns == 1
    assert SEEN["edited"].status_code == 409 and "do not continue this session's history" in str(SEEN["edited"])
    sample = t.to_sample()
    assert sample.response_tokens == tokenizer.encode(CALL_TEXT, add_special_tokens=False)  # nothing re-encoded
    assert episode_metrics([sample])["episode_history_edited_frac"] == 1.0


def greedy_agent(task: AgentTask):
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    try:
        client.chat.completions.create(model=task.model, messages=task.messages, temperature=0.0)
    except openai.BadRequestError as exc:
        SEEN["refused"] = exc
    r = client.chat.completions.create(model=task.model, messages=task.messages, temperature=1.0, max_tokens=3)
    SEEN["short"] = r


def test_sampling_fields_that_change_the_behaviour_policy_are_refused_by_name(tokenizer):
    SEEN.clear()
    t, *_ = run_episode(tokenizer, "tests.unit.test_openai_endpoint:greedy_agent", [ANSWER_TEXT])
    assert SEEN["refused"].status_code == 400 and "temperature=0.0: the rollout samples at temperature=1.0" in str(
        SEEN["refused"]
    )
    # max_tokens lowers the turn's limit; the episode then ends with the agent
    assert (
        len(SEEN["short"].model_extra["megarl"]["token_ids"]) == 3
        and SEEN["short"].choices[0].finish_reason == "length"
    )
    assert t.finish == "length" and t.turns == 1


def looping_agent(task: AgentTask):
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages = list(task.messages)
    SEEN["thread"] = threading.current_thread()
    try:
        while True:
            r = client.chat.completions.create(model=task.model, messages=messages)
            messages += [r.choices[0].message.model_dump(), {"role": "user", "content": "again"}]
    except openai.APIStatusError as exc:
        SEEN["ended"] = exc


def test_the_turn_limit_ends_the_episode_and_the_agent(tokenizer):
    SEEN.clear()
    t, *_ = run_episode(tokenizer, "tests.unit.test_openai_endpoint:looping_agent", [ANSWER_TEXT], max_turns=3)
    assert t.finish == "max_turns" and t.turns == 3
    SEEN["thread"].join(timeout=10)
    assert not SEEN["thread"].is_alive() and SEEN["ended"].status_code == 409
    assert "episode has ended (max_turns)" in str(SEEN["ended"])


def failing_agent(task: AgentTask):
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    client.chat.completions.create(model=task.model, messages=task.messages)
    raise ValueError("the agent's own bug")


def completion_agent(task: AgentTask):
    """A text-completion agent: resends its whole transcript each call."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    prompt = "Q: 12 * 7?\nA:"
    r = client.completions.create(model=task.model, prompt=prompt, max_tokens=64)
    prompt += r.choices[0].text + "\nObservation: 84\nA:"  # the text has no end-of-turn token
    r = client.completions.create(model=task.model, prompt=prompt, max_tokens=64)
    SEEN["completion"] = r


def test_a_failing_agent_and_a_completions_agent(tokenizer):
    t, *_ = run_episode(tokenizer, "tests.unit.test_openai_endpoint:failing_agent", [ANSWER_TEXT])
    assert (
        t.finish == "env_error"
        and t.meta["env_error"] == "MegarlError: rollout.agent raised ValueError: the agent's own bug"
    )

    SEEN.clear()
    t, *_ = run_episode(tokenizer, "tests.unit.test_openai_endpoint:completion_agent", [CALL_TEXT, ANSWER_TEXT])

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    # the first prompt replaces the dataset's; the second adds only its new text's ids, after the
    # sampled end-of-turn token the answer's text leaves out
    assert t.prompt_ids == ids("Q: 12 * 7?\nA:") and t.finish == "done" and t.turns == 2
    assert t.context() == ids("Q: 12 * 7?\nA:") + ids(CALL_TEXT) + ids("\nObservation: 84\nA:") + ids(ANSWER_TEXT)
    assert SEEN["completion"].choices[0].text == "The answer is 84."
