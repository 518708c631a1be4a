"""`megarl train` with multi-turn episodes (rollout.env): every trained sample is 3 generated turns and
2 inserted tool responses, the inserted ids exactly the environment's ChatML encoding with loss mask
0, the generated ids the sampler's, and the episode metrics reported per step."""

from __future__ import annotations

import math

import pytest

from tests.multiprocess.test_rl_loop import _train


@pytest.mark.slow
def test_multi_turn_episodes_train_end_to_end(tmp_path):
    from megarl.config import load_config
    from megarl.environments.factory import chatml_format
    from megarl.generator.tokenizer import load_tokenizer
    from megarl.model_source import _smollm2_tokenizer
    from tests.unit.test_rl_loop import ROOT, TINY

    summary, metrics, rollouts = _train(
        tmp_path / "run",
        "rollout.env=tests.episode_envs_for_tests:two_tool_turns",
        "rollout.max_turns=3",
        "run.steps=2",
        "generator.max_seq_len=192",
    )
    assert len(metrics) == 2 and rollouts
    tokenizer = load_tokenizer(_smollm2_tokenizer(ROOT / load_config(TINY).model.cache_dir))
    fmt = chatml_format(tokenizer)
    for r in rollouts:
        mask, ids = r["loss_mask"], r["response_tokens"]
        assert r["episode"]["turns"] == 3 and r["episode"]["tool_calls"] == 2, r["episode"]
        # the segments: runs of mask 1 (sampled) and 0 (inserted), alternating, 3 and 2 of them
        runs = [mask[0]] + [m for a, m in zip(mask, mask[1:]) if m != a]
        assert runs == [1, 0, 1, 0, 1], runs
        # each turn's sampled ids, as the overlong penalty reads them: the runs of mask 1, in order
        turns = [len(run) for run in "".join(map(str, mask)).split("0") if run]
        assert r["episode"]["turn_tokens"] == turns, (r["episode"], turns)
        pos = 0
        for _ in range(2):  # each inserted run is the environment's glue for the turn before it
            start = mask.index(0, pos)
            end = mask.index(1, start)
            assert ids[start:end] == fmt.tool_response_ids(ids[pos:start], ["42"])
            pos = end
        trained = [v for v, m in zip(r["behaviour_logprobs"], mask) if m]
        assert all(v <= 0 for v in trained) and all(
            math.isnan(v) for v, m in zip(r["behaviour_logprobs"], mask) if not m
        )
        assert all(v >= 0 for v, m in zip(r["versions"], mask) if m)
        assert all(v == -1 for v, m in zip(r["versions"], mask) if not m)
        # each turn's prompt is the whole context so far: prefilled, or kept by the engine's parked slot
        starts = [0] + [i for i in range(1, len(mask)) if mask[i] == 1 and mask[i - 1] == 0]
        contexts = sum(len(r["prompt_tokens"]) + s for s in starts)
        e = r["episode"]
        assert e["prefill_tokens"] + e["cached_tokens"] == contexts and e["cached_tokens"] > 0, e
    for m in metrics:
        assert m["episode_turns"] == 3 and m["episode_tool_calls"] == 2 and m["episode_turn_limit_frac"] == 0
        # the trainer's log-probs at the trained positions are the sampler's (the math reward gives a random
        # model 0, so the policy does not move): ids or mask shifted by one token would put KL near 1
        assert m["kl_mu_pi"] < 1e-6, m["kl_mu_pi"]
    assert summary


@pytest.mark.slow
def test_an_openai_client_agent_trains_end_to_end(tmp_path):
    """rollout.agent: each episode is an `openai` client loop against the replica's endpoint, two
    calls; the trainer sees the agent's own system prompt as the prompt, the two sampled turns and,
    between them, exactly the ids of the tool message the agent added (SmolLM2's template has no
    tool role: a user turn of <tool_response>, written out here), and its log-probs are the sampler's."""
    from megarl.config import load_config
    from megarl.generator.tokenizer import load_tokenizer
    from megarl.model_source import _smollm2_tokenizer
    from tests.agents_for_tests import SYSTEM
    from tests.unit.test_rl_loop import ROOT, TINY

    summary, metrics, rollouts = _train(
        tmp_path / "run",
        "rollout.agent=tests.agents_for_tests:two_call_agent",
        "rollout.max_turns=3",
        "run.steps=2",
        "generator.max_seq_len=320",
    )
    assert len(metrics) == 2 and rollouts
    tokenizer = load_tokenizer(_smollm2_tokenizer(ROOT / load_config(TINY).model.cache_dir))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    glue = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    for r in rollouts:
        assert tokenizer.decode(r["prompt_tokens"]).startswith(f"<|im_start|>system\n{SYSTEM}\n\n# Tools")
        mask, ids = r["loss_mask"], r["response_tokens"]
        assert r["episode"]["turns"] == 2 and r["episode"]["finish"] in ("done", "length"), r["episode"]
        runs = [mask[0]] + [m for a, m in zip(mask, mask[1:]) if m != a]
        assert runs == [1, 0, 1], runs
        start, end = mask.index(0), mask.index(1, mask.index(0))
        want = tokenizer.encode(glue, add_special_tokens=False)
        if ids[start - 1] != im_end:  # a first turn cut by max_new_tokens: the template's end marker is inserted
            want = tokenizer.encode("<|im_end|>" + glue, add_special_tokens=False)
        assert ids[start:end] == want
    for m in metrics:
        assert m["episode_turns"] == 2 and m["episode_history_edited_frac"] == 0
        assert m["kl_mu_pi"] < 1e-6, m["kl_mu_pi"]
    assert summary
