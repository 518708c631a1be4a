"""Multi-turn episodes, token in and token out: the trajectory is exactly the sampled and inserted
ids (never a re-encoding), environment ids are masked, behaviour log-probs and versions are the
sampler's, an in-flight update mid-episode gives two versions; through a scripted backend with
the calculator, and through megarl's torch engine against transformers' own log-probs."""

import dataclasses
import math
import re
from typing import List

import pytest
import torch

from megarl.environments.calculator import Calculator
from megarl.environments.episode import (
    GENERATED,
    INSERTED,
    EpisodeRunner,
    EpisodeSettings,
    StepResult,
    Trajectory,
    Turn,
)
from megarl.environments.tool_env import ChatMLToolFormat, ToolEnvironment
from megarl.errors import MegarlError
from megarl.generator.interface import Completion, GeneratorBackend, SamplingParams

SPECIALS = {"<|im_start|>": 1, "<|im_end|>": 2}


def encode(text: str) -> List[int]:
    """A character tokenizer with ChatML's two special tokens (written independently of megarl)."""
    ids, pattern = [], re.compile("|".join(map(re.escape, SPECIALS)))
    pos = 0
    for m in pattern.finditer(text):
        ids += [10 + ord(c) for c in text[pos : m.start()]] + [SPECIALS[m.group()]]
        pos = m.end()
    return ids + [10 + ord(c) for c in text[pos:]]


def decode(ids: List[int]) -> str:
    names = {v: k for k, v in SPECIALS.items()}
    return "".join(names.get(i, chr(i - 10) if i >= 10 else "") for i in ids)


class ScriptedBackend(GeneratorBackend):
    """Answers each episode's k-th turn with its k-th scripted text; log-prob of the j-th token of a
    turn -0.01 (j + 1); the version bumps after ``bump_after`` tokens in all (an in-flight update)."""

    def __init__(self, scripts, bump_after=None):
        self.scripts, self.bump_after, self.emitted, self.version = scripts, bump_after, 0, 1
        self.pending, self.prompts = [], {}

    def submit(self, requests):
        self.pending += requests

    def step(self):
        out = []
        for r in self.pending:
            turn = int(r.request_id.split("/turn")[1])
            self.prompts[(r.group_id, turn)] = list(r.prompt_ids)
            script = self.scripts[r.group_id][turn]
            ids = encode(script)[: r.params.max_new_tokens]
            versions = []
            for _ in ids:
                versions.append(self.version)
                self.emitted += 1
                if self.bump_after and self.emitted == self.bump_after:
                    self.version += 1
            finish = "stop" if len(ids) == len(encode(script)) else "length"
            logprobs = [-0.01 * (j + 1) for j in range(len(ids))]
            out.append(Completion(r.request_id, 0, r.group_id, list(r.prompt_ids), ids, logprobs, versions, finish))
        self.pending = []
        return out

    def abort(self, request_ids):
        pass

    def update_weights(self, apply):
        return apply()

    def stats(self):
        return {}


CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call><|im_end|>'
GLUE = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def reward_84(text, trajectory):
    return 1.0 if "84" in text else 0.0


def runner(backend, max_new_tokens=200, **settings):
    tools = {"calculator": Calculator()}
    fmt = ChatMLToolFormat(encode, SPECIALS["<|im_end|>"])
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return EpisodeRunner(
        backend, lambda i: ToolEnvironment(tools, fmt, reward_84), decode, params, EpisodeSettings(**settings)
    )


def test_three_turn_tool_episode_is_exactly_the_sampled_and_inserted_ids():
    turns = [CALL.format("12 * 7"), CALL.format("1 / 0"), "The answer is 84.<|im_end|>"]
    prompt = encode("<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n")
    backend = ScriptedBackend([turns], bump_after=len(encode(turns[0])) + 5)  # lands inside turn 2
    [t] = runner(backend).run([prompt])
    inserted = [encode(GLUE.format("84")), encode(GLUE.format("error: division by zero"))]
    want = prompt + encode(turns[0]) + inserted[0] + encode(turns[1]) + inserted[1] + encode(turns[2])
    assert t.context() == want and t.finish == "done" and t.turns == 3
    assert [s.kind for s in t.segments] == [GENERATED, INSERTED, GENERATED, INSERTED, GENERATED]
    # every turn was generated from exactly the episode's context so far
    assert backend.prompts[(0, 1)] == prompt + encode(turns[0]) + inserted[0]
    assert backend.prompts[(0, 2)] == want[: len(want) - len(encode(turns[2]))]
    assert (t.tool_calls, t.tool_errors, t.reward) == (2, 1, 1.0)

    sample = t.to_sample()
    sample.validate()
    assert sample.prompt_tokens == prompt and sample.response_tokens == want[len(prompt) :]
    n = [len(encode(x)) for x in (turns[0], GLUE.format("84"), turns[1], GLUE.format("error: division by zero"))]
    mask = [1] * n[0] + [0] * n[1] + [1] * n[2] + [0] * n[3] + [1] * len(encode(turns[2]))
    assert sample.loss_mask == mask and sample.trained_tokens == sum(mask)
    trained_logprobs = sample.trained(sample.behaviour_logprobs)
    assert trained_logprobs == [-0.01 * (j + 1) for x in turns for j in range(len(encode(x)))]
    assert all(math.isnan(v) for v, m in zip(sample.behaviour_logprobs, mask) if not m)
    versions = sample.trained(sample.policy_versions)
    assert sorted(set(versions)) == [1, 2] and versions.index(2) == n[0] + 5  # two versions, one trajectory
    assert t.oldest_version == 1


def test_episode_limits_end_it_with_the_reason():
    forever = [CALL.format("1 + 1")] * 10
    [t] = runner(ScriptedBackend([forever]), max_turns=3).run([encode("q")])
    assert t.finish == "max_turns" and t.turns == 3 and t.tool_calls == 3
    [t] = runner(ScriptedBackend([forever]), max_context=150).run([encode("q")])
    assert t.finish == "length" and len(t.context()) == 150  # the last turn cut at the context limit


def test_overlong_penalty_judges_each_turn_against_its_own_limit():
    """rollout.max_new_tokens is a turn's limit: an episode is penalised for its worst turn, never for
    its whole length (tool output and later turns included). The demo's fp32 collapse (issue 53)
    had correct 3-turn episodes with no turn cut penalised -1 for their total length."""
    from megarl.config import RolloutConfig, TrainerConfig
    from megarl.rollout import EpisodeStats, sampled_turn_lengths
    from megarl.trainer.aggregation import sample_overlong_penalty
    from megarl.trainer.bound_loss import bind_loss
    from megarl.trainer.policy_trainer import shape_batch

    limit, buffer = 128, 32  # the tools demo's: no penalty up to 96 sampled ids, -1 at 128
    answer = "The answer is 84.<|im_end|>"
    call = CALL.format("12 * 7")  # 85 ids
    thinking = "Let me use the calculator for this product, then read off its result. "
    in_buffer = thinking[: 104 - len(encode(call))] + call  # 104 ids: (104 - 96) / 32 -> -0.25
    cut = call + " and so on" * 10  # runs past the limit: cut at 128 ids after a complete call
    scripts = [
        [call, call, answer],  # 85 + 85 + 18 sampled ids, each turn well under the limit
        [in_buffer, answer],
        [cut, answer],
    ]
    done = sorted(runner(ScriptedBackend(scripts), limit).run([encode("q")] * 3), key=lambda t: t.group_id)
    samples = [t.to_sample() for t in done]
    for s in samples:
        s.group_id = 0
    assert [sampled_turn_lengths(s) for s in samples] == [[85, 85, 18], [104, 18], [128, 18]]
    # each episode's total length is past the limit, and every one ended with the right answer
    assert all(len(s.response_tokens) > limit and s.reward == 1.0 for s in samples)
    assert [s.finish_reason for s in samples] == ["stop"] * 3  # no last turn was cut: none truncated
    assert [sample_overlong_penalty(s, limit, buffer) for s in samples] == [0.0, -0.25, -1.0]

    # through the trainer's own path: the shaped rewards 1, 0.75 and 0 less their group's mean
    loss = bind_loss(TrainerConfig(overlong="penalty", overlong_buffer=buffer), RolloutConfig(max_new_tokens=limit), 0)
    kept, advantages, info = shape_batch(samples, loss)
    assert kept == samples and advantages == pytest.approx([1 - 1.75 / 3, 0.75 - 1.75 / 3, -1.75 / 3])
    assert info["overlong_penalty_mean"] == pytest.approx(-1.25 / 3) and info["truncated_frac"] == 0.0

    # a rollout recorded before turns were kept: the loss mask's runs of sampled ids give the same turns
    old = [dataclasses.replace(s, episode=dataclasses.replace(s.episode, turn_tokens=())) for s in samples]
    assert [sampled_turn_lengths(s) for s in old] == [[85, 85, 18], [104, 18], [128, 18]]
    # read back from JSON (a list): the same episode, hashable as one
    assert EpisodeStats(3, turn_tokens=[85, 85, 18]) == EpisodeStats(3, turn_tokens=(85, 85, 18))
    assert hash(EpisodeStats(3, turn_tokens=[85, 85, 18])) == hash(EpisodeStats(3, turn_tokens=(85, 85, 18)))


class Stuck:
    def reset(self, trajectory):
        return []

    def step(self, turn):
        import time

        time.sleep(5)
        return StepResult(done=True)


class Broken:
    def reset(self, trajectory):
        return []

    def step(self, turn):
        raise RuntimeError("environment bug")


def test_a_stuck_or_failing_environment_ends_its_episode_not_the_job():
    backend = ScriptedBackend([["a<|im_end|>"], ["b<|im_end|>"], ["c<|im_end|>"]])
    envs = [Stuck(), Broken(), ToolEnvironment({}, ChatMLToolFormat(encode, 2), reward_84)]
    r = EpisodeRunner(backend, lambda i: envs[i], decode, SamplingParams(), EpisodeSettings(env_timeout_s=0.3))
    done = {t.group_id: t for t in r.run([encode("x")] * 3)}
    assert done[0].finish == "env_timeout" and done[1].finish == "env_error"
    assert done[1].meta["env_error"] == "RuntimeError: environment bug" and done[2].finish == "done"
    assert r.counters["env_timeouts"] == 1 and r.counters["env_errors"] == 1


def test_a_context_changed_by_the_backend_is_refused():
    t = Trajectory("p0#0", [5, 6])
    bad = Completion("p0#0/turn0", 0, 0, [5, 7], [8], [-0.1], [1], "stop")
    with pytest.raises(MegarlError, match="a context other than the episode's"):
        t.add_generated(bad)


class InsertFixed:
    """Inserts fixed ids after each turn, for two turns."""

    def __init__(self):
        self.turns = 0

    def reset(self, trajectory):
        return [7, 8]

    def step(self, turn: Turn):
        self.turns += 1
        return StepResult(insert_ids=[11, 12, 13], done=self.turns == 3)


def test_torch_engine_episode_logprobs_are_transformers_on_the_final_context(tmp_path):
    """Three sampled turns on megarl's engine (temperature 1, each turn prefilled from the whole
    context); transformers' log-softmax of the final trajectory at every generated token equals
    the behaviour log-prob the sampler recorded: the ids are the ones that were scored."""
    from transformers import AutoModelForCausalLM

    from megarl.generator.torch_engine.engine import TorchEngine
    from megarl.generator.weights import load_generator_params
    from megarl.models.hf_checkpoint import SafetensorsCheckpoint
    from tests.conftest import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "hf")
    hf = SafetensorsCheckpoint(model_dir)
    engine = TorchEngine(hf.spec, load_generator_params(hf, 1, 0, torch.float32), max_running=2, max_seq_len=128)
    # a third of the vocabulary stops a turn: turns of ~3 tokens, none near the 30-token cap
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3, stop_token_ids=tuple(range(0, 300, 3)))
    r = EpisodeRunner(engine, lambda i: InsertFixed(), lambda ids: "", params, EpisodeSettings(max_turns=5))
    trajectories = r.run([[3, 4, 5, 6], [9, 10]])
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for t in trajectories:
        assert t.finish == "done" and [s.kind for s in t.segments] == [INSERTED] + [GENERATED, INSERTED] * 2 + [
            GENERATED
        ]
        ids = t.context()
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
        pos = len(t.prompt_ids)
        for s in t.segments:
            if s.kind == GENERATED:
                want = [logp[pos + j - 1, tok].item() for j, tok in enumerate(s.token_ids)]
                assert max(abs(a - b) for a, b in zip(s.logprobs, want)) < 1e-4, t.episode_id
            pos += len(s.token_ids)


@pytest.mark.parametrize("max_running,park_timeout_s", [(2, 1.0), (1, 0.0), (1, 3600.0)])
def test_parked_sessions_prefill_only_the_inserted_ids_and_sample_what_a_full_prefill_samples(
    tmp_path, max_running, park_timeout_s
):
    """Three 3-turn episodes on megarl's engine, fp32, seeded temperature-1 sampling: with each turn's
    slot parked for the episode's next one, the sampled ids equal those of the same engine prefilling
    every context from scratch (`megarl bench episodes`' baseline arm), the log-probs agree to fp32
    rounding (tests/fp32_bounds.py), and the engine prefilled exactly the first context plus, at each
    later turn, the inserted ids and the previous turn's last sampled id (whose keys no forward had
    written), counted from the trajectories' own segments. With one slot
    and no patience (timeout 0) a waiting episode evicts the parked one, which then prefills its whole
    context again; with one slot and a long timeout the others wait and nothing is evicted. Every slot
    is free when the episodes end."""
    from megarl.bench.episodes import ForgetSessions
    from megarl.generator.torch_engine.engine import TorchEngine
    from megarl.generator.weights import load_generator_params
    from megarl.models.hf_checkpoint import SafetensorsCheckpoint
    from tests.conftest import make_tiny_llama
    from tests.fp32_bounds import fp32_logprob_bound

    hf = SafetensorsCheckpoint(make_tiny_llama(tmp_path / "hf"))
    params = load_generator_params(hf, 1, 0, torch.float32)

    def engine():
        return TorchEngine(hf.spec, params, max_running=max_running, max_seq_len=128, kv_park_timeout_s=park_timeout_s)

    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, stop_token_ids=tuple(range(0, 300, 4)))
    prompts = [[3, 4, 5, 6], [9, 10], [21, 22, 23]]

    def run(backend):
        r = EpisodeRunner(backend, lambda i: InsertFixed(), lambda ids: "", sampling, EpisodeSettings(max_turns=5))
        return sorted(r.run(prompts), key=lambda t: t.episode_id)

    parked_engine, plain_engine = engine(), engine()
    parked, plain = run(parked_engine), run(ForgetSessions(plain_engine))
    # the same fp32 engine on the same ids, prefilled in other pieces (tests/fp32_bounds.py; 1e-5 set
    # by hand before, 8.1e-6 measured on an AVX512 EPYC): a wrong position or a stale key moves a
    # log-prob by far more than either
    bound = fp32_logprob_bound(hf.path, [t.context() for t in parked])
    for a, b in zip(parked, plain):
        assert a.context() == b.context(), a.episode_id
        la = [x for s in a.segments if s.kind == GENERATED for x in s.logprobs]
        lb = [x for s in b.segments if s.kind == GENERATED for x in s.logprobs]
        worst = max(abs(x - y) for x, y in zip(la, lb))
        print(f"{a.episode_id}: parked vs full prefill, max |dlogp| {worst:.2e} (bound {bound:.2e})")
        assert worst <= bound, (a.episode_id, worst, bound)
    full = sum(len(t.prompt_ids) + len(t.segments[0].token_ids) for t in parked)  # reset's ids, then turn 1
    for t in parked:
        context = len(t.prompt_ids) + len(t.segments[0].token_ids)
        for s in t.segments[1:]:
            context += len(s.token_ids)
            if s.kind == INSERTED:
                full += context  # the next turn's whole context, prefilled from scratch
    minimal = sum(
        len(t.prompt_ids) + len(t.segments[0].token_ids) + sum(len(s.token_ids) + 1 for s in t.segments[2::2])
        for t in parked
    )
    stats, plain_stats = parked_engine.stats(), plain_engine.stats()
    assert plain_stats["prefill_tokens"] == full and plain_stats["cached_tokens"] == 0
    assert stats["prefill_tokens"] + stats["cached_tokens"] == full
    assert sum(t.stats().prefill_tokens for t in parked) == stats["prefill_tokens"]
    assert sum(t.stats().cached_tokens for t in parked) == stats["cached_tokens"]
    if park_timeout_s == 0.0:  # one slot, three episodes: parked turns were evicted and prefilled again
        assert stats["kv_evictions"] > 0 and stats["prefill_tokens"] > minimal
    else:
        assert stats["kv_evictions"] == 0 and stats["prefill_tokens"] == minimal
    assert stats["kv_parked"] == 0 and sorted(parked_engine.free_slots) == list(range(max_running))


def test_a_session_is_one_sample_and_an_aborted_parked_episode_frees_its_slot(tmp_path):
    from megarl.environments.multi_turn import MultiTurnBackend
    from megarl.errors import ConfigError
    from megarl.generator.interface import GenerationRequest
    from megarl.generator.torch_engine.engine import TorchEngine
    from megarl.generator.weights import load_generator_params
    from megarl.models.hf_checkpoint import SafetensorsCheckpoint
    from tests.conftest import make_tiny_llama

    hf = SafetensorsCheckpoint(make_tiny_llama(tmp_path / "hf"))
    engine = TorchEngine(hf.spec, load_generator_params(hf, 1, 0, torch.float32), max_running=2, max_seq_len=64)
    with pytest.raises(ConfigError, match="session s asks for n=2"):
        engine.submit([GenerationRequest("r", [3, 4], SamplingParams(max_new_tokens=2), n=2, session_id="s")])

    class Slow(InsertFixed):
        def step(self, turn):
            import time

            time.sleep(0.2)  # the episode stays parked while its "tool" runs
            return super().step(turn)

    episodes = MultiTurnBackend(engine, lambda i: Slow(), lambda ids: "", EpisodeSettings(max_turns=5))
    episodes.submit([GenerationRequest("p", [3, 4, 5], SamplingParams(max_new_tokens=1, seed=1), n=2)])
    while engine.stats()["kv_parked"] < 2:
        episodes.step()
    episodes.abort(["p"])
    assert engine.stats()["kv_parked"] == 0 and sorted(engine.free_slots) == [0, 1]


def test_an_episodes_loss_and_gradient_are_the_float64_reference_over_its_sampled_tokens():
    """Two 3-turn calculator episodes of one group (one answers 84: reward 1, one does not: 0) through
    the trainer's path (shape_batch, packing, the hook's trained positions and micro-batch loss, AIPO,
    token mean): the loss and its gradient with respect to every response token's log pi equal the
    definitions (tests/loss_references.py) in float64 over the sampled tokens alone; the inserted tool
    responses, which hold log pi = +3 here, get exactly no gradient."""
    from megarl.config import RolloutConfig, TrainerConfig
    from megarl.trainer.bound_loss import bind_loss
    from megarl.trainer.hooks import micro_batch_loss, trained_positions
    from megarl.trainer.packing import plan_micro_batches
    from megarl.trainer.policy_trainer import shape_batch
    from tests.loss_references import RefSample, objective

    prompt = encode("<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n")
    scripts = [
        [CALL.format("12 * 7"), CALL.format("1 / 0"), "The answer is 84.<|im_end|>"],
        [CALL.format("12 + 7"), CALL.format("2 ** 3"), "It is 19.<|im_end|>"],
    ]
    trajectories = {t.group_id: t for t in runner(ScriptedBackend(scripts)).run([prompt, prompt])}
    samples = []
    for k in (0, 1):
        s = trajectories[k].to_sample()
        s.group_id = 0
        samples.append(s)
    assert [s.reward for s in samples] == [1.0, 0.0] and all(s.loss_mask.count(0) > 40 for s in samples)

    bound = bind_loss(TrainerConfig(loss="aipo"), RolloutConfig(temperature=1.0, max_new_tokens=200), lag_bound=4)
    kept, advantages, _ = shape_batch(samples, bound)
    assert advantages == [0.5, -0.5]
    f32 = [[torch.tensor(x, dtype=torch.float32).item() for x in s.trained(s.behaviour_logprobs)] for s in samples]
    # log pi of each sampled token off its log mu by up to 0.3 (ratios 0.74 .. 1.35), +3 at inserted ones
    logp, it = [], 0
    for k, s in enumerate(samples):
        values, mu = [], iter(f32[k])
        for m in s.loss_mask:
            it += 1
            values.append(next(mu) + 0.3 * math.sin(it) if m else 3.0)
        logp.append(torch.tensor(values, dtype=torch.float64, requires_grad=True))
    [mb] = plan_micro_batches(kept, advantages, 0, 1, 4096, False, False, version=1).micro_batches
    parts = [torch.full((0,), 0.0, dtype=torch.float64)]
    for i in mb.sample_indices:
        parts += [torch.full((len(kept[i].prompt_tokens) - 1,), 3.0, dtype=torch.float64), logp[i]]
    parts.append(torch.full((mb.length - sum(len(kept[i]) for i in mb.sample_indices),), 3.0, dtype=torch.float64))
    row = torch.cat(parts)
    on = trained_positions(mb)
    loss_sum, count, _ = micro_batch_loss(bound, mb, on, row[on], torch.zeros_like(row[on]))
    value = loss_sum / count
    value.backward()

    trained = [[v for v, m in zip(x.tolist(), s.loss_mask) if m] for x, s in zip(logp, samples)]
    batch = [RefSample(trained[k], f32[k], advantages[k]) for k in (0, 1)]
    ref = objective("aipo", {}, "token_mean", batch, 200)
    assert int(count) == sum(s.trained_tokens for s in samples)
    assert value.item() == pytest.approx(ref.value, rel=1e-10, abs=1e-12)
    for k, s in enumerate(samples):
        grad = logp[k].grad.tolist()
        assert [g for g, m in zip(grad, s.loss_mask) if not m] == [0.0] * s.loss_mask.count(0)
        assert [g for g, m in zip(grad, s.loss_mask) if m] == pytest.approx(ref.grad_logp[k], rel=1e-10, abs=1e-13)
    # the mask is what the reference turns on: over every response token the loss would be another
    everything = [RefSample(x.tolist(), [v if m else 3.0 for v, m in zip(s.behaviour_logprobs, s.loss_mask)],
                            a) for x, s, a in zip(logp, samples, advantages)]  # fmt: skip
    assert abs(objective("aipo", {}, "token_mean", everything, 200).value - ref.value) > 1e-3
