"""Packing samples into micro-batches: alignment of per-token fields, masks, balance."""

import pytest
import torch

from megarl.errors import ConfigError
from megarl.rollout import Sample
from megarl.trainer.packing import build_micro_batch, plan_micro_batches, split_across_dp


def make(prompt_len, response_len, group=0, reward=0.0, base=0):
    prompt = list(range(base, base + prompt_len))
    response = list(range(base + 100, base + 100 + response_len))
    mu = [-0.1 * (j + 1) for j in range(response_len)]
    return Sample(prompt, response, mu, [7] * response_len, reward, group)


def test_fields_line_up_with_targets():
    a, b = make(3, 2, base=10), make(2, 3, base=20)
    mb = build_micro_batch([a, b], [0.5, -1.0], [0, 1], row_length=10, thd=False)
    # a: tokens 10 11 12 110 111 -> inputs 10 11 12 110, targets 11 12 110 111
    assert mb.input_ids[0, :4].tolist() == [10, 11, 12, 110]
    assert mb.targets[0, :4].tolist() == [11, 12, 110, 111]
    assert mb.loss_mask[0, :4].tolist() == [0, 0, 1, 1]
    assert mb.behaviour_logprobs[0, 2:4].tolist() == pytest.approx([-0.1, -0.2])
    assert mb.advantages[0, :4].tolist() == [0, 0, 0.5, 0.5]
    # b starts at position 4 with positions restarting at 0
    assert mb.position_ids[0, 4:8].tolist() == [0, 1, 2, 3]
    assert mb.targets[0, 4:8].tolist() == [21, 120, 121, 122]
    assert mb.loss_mask[0, 4:8].tolist() == [0, 1, 1, 1]
    assert mb.policy_versions[0].tolist() == [-1, -1, 7, 7, -1, 7, 7, 7, -1, -1]
    # padding: two positions, masked out of the loss
    assert mb.real_tokens == 8 and mb.loss_mask[0, 8:].sum() == 0
    mask = mb.attention_mask[0, 0]
    assert not mask[5, 4] and mask[4, 5]  # causal inside b
    assert mask[4, 3] and mask[3, 4]  # nothing across samples


def test_thd_format_for_transformer_engine():
    mb = build_micro_batch([make(3, 2), make(2, 3)], [0, 0], [0, 1], row_length=10, thd=True)
    assert mb.attention_mask is None
    assert mb.packed_seq_params.qkv_format == "thd"
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 4, 8, 10]


def test_plan_balances_dp_and_reports_efficiency():
    samples = [make(4, n) for n in (12, 3, 7, 9, 5, 6)]  # positions 15 6 10 12 8 9 = 60
    parts = split_across_dp([len(s) for s in samples], 2)
    loads = [sum(len(samples[i]) for i in p) for p in parts]
    assert sorted(loads) == [30, 30]
    plans = [plan_micro_batches(samples, [0.0] * 6, r, 2, 16, fixed_row_length=False, thd=False) for r in range(2)]
    assert len(plans[0].micro_batches) == len(plans[1].micro_batches)
    covered = sorted(i for p in plans for mb in p.micro_batches for i in mb.sample_indices)
    assert covered == list(range(6))
    assert plans[0].efficiency == pytest.approx(60 / sum(mb.length for p in plans for mb in p.micro_batches))
    fixed = plan_micro_batches(samples, [0.0] * 6, 0, 2, 16, fixed_row_length=True, thd=False, count_multiple=4)
    assert len(fixed.micro_batches) == 4 and all(mb.length == 16 for mb in fixed.micro_batches)


def test_sample_longer_than_budget_is_named():
    with pytest.raises(ConfigError, match=r"sample 1 spans 20 positions .* max_tokens_per_microbatch=16"):
        plan_micro_batches([make(2, 2), make(5, 16)], [0, 0], 0, 1, 16, False, False)


def test_inconsistent_sample_is_named():
    from megarl.rollout import validate_samples

    bad = make(3, 4)
    bad.behaviour_logprobs = bad.behaviour_logprobs[:-1]
    with pytest.raises(ConfigError, match="sample 1 .*behaviour_logprobs has 3 entries for 4 response tokens"):
        validate_samples([make(2, 2), bad])
    assert torch.is_tensor(build_micro_batch([make(2, 2)], [0.0], [0], 3, False).input_ids)
