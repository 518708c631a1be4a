"""The sampler's draw: the categorical distribution of its row, from the row's own generator."""

import math

import pytest
import torch

from megarl.generator import sampling
from megarl.generator.interface import SamplingParams


def test_draw_follows_the_row_distribution_and_never_picks_a_zero_entry():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    rows = 20000
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    chosen = sampling.draw(probs.expand(rows, -1) * 3.0, gens)  # unnormalised rows are fine
    counts = torch.bincount(chosen, minlength=5).double()
    assert counts[1] == 0 and counts[4] == 0
    for p, c in zip(probs.tolist(), counts.tolist()):
        sigma = math.sqrt(rows * p * (1 - p)) or 1.0
        assert abs(c - rows * p) <= 4.5 * sigma, (p, c)


def test_a_row_draw_depends_on_its_generator_only():
    probs = torch.softmax(torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)), -1)
    first = sampling.draw(probs, [torch.Generator().manual_seed(7 + i) for i in range(6)])
    # row 3 alone, with the same generator state: the same token
    alone = sampling.draw(probs[3:4], [torch.Generator().manual_seed(10)])
    assert int(alone[0]) == int(first[3])


def test_a_uniform_rounded_up_to_the_total_takes_the_last_entry_with_mass(monkeypatch):
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.ones(1))
    chosen = sampling.draw(torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]]), [None, None])
    assert chosen.tolist() == [1, 3]


def test_temperature_rows_record_the_log_prob_of_the_drawn_token():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=0.7, max_new_tokens=1)] * 4
    tokens, logprobs = sampling.sample(logits, params, [torch.Generator().manual_seed(i) for i in range(4)])
    want = torch.log_softmax(logits.double() / 0.7, -1)
    for row, (t, lp) in enumerate(zip(tokens, logprobs)):
        assert abs(want[row, t].item() - lp) <= 1e-6


def test_draw_reads_no_value_on_the_host():
    """On the meta device (shapes, no values) an op that must read a value on the host to go on
    raises -- on a GPU, a synchronisation per step. The draw runs there; the per-row fallback it
    replaced (which rows rounded past the total: ``nonzero``, then a loop over them) does not."""
    probs = torch.rand(4, 50).to("meta")
    chosen = sampling.draw(probs, [torch.Generator().manual_seed(i) for i in range(4)])
    assert chosen.device.type == "meta" and chosen.shape == (4,) and chosen.dtype == torch.long
    with pytest.raises(NotImplementedError, match="nonzero"):
        (chosen >= probs.shape[-1]).nonzero()
