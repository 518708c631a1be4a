"""Whole RL optimizer steps through PolicyTrainer: a user loss picked by dotted path,
the non-finite guard, a KL penalty against a frozen reference model, and the metrics."""

import json

import pytest
import torch

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from tests.conftest import run_ranks
from tests.rl_batch import make_samples, save_samples

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stepped(tiny_hf, tiny_megatron, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_step")
    save_samples(make_samples(tiny_hf, vocab_size=300), out / "samples.pt")
    run_ranks(2, "rl_step_worker.py", "--checkpoint", tiny_megatron, "--samples", out / "samples.pt",
              "--out", out, "--layout", "1x2")
    return out, json.loads((out / "metrics.json").read_text())


def weights(ckpt, vocab=300):
    """Global weights; vocabulary tensors cut to the real vocabulary (padding depends on TP)."""
    reader = DistCheckpointReader(ckpt / "release")
    out = {}
    for key in reader.metadata.state_dict_metadata:
        if key.startswith(("embedding", "decoder", "output")):
            out[key] = reader.read(key)[:vocab] if key.startswith(("embedding", "output")) else reader.read(key)
    return out


def test_user_loss_by_dotted_path_takes_a_real_step(stepped, tiny_megatron):
    out, metrics = stepped
    m = metrics["custom"][0]
    assert not m["skipped"] and m["response_tokens"] == 84 and m["samples"] == 8
    assert 0 < m["clip_frac"] < 0.5 and m["ratio_max"] > 4.0 and 0 < m["ess"] < 1
    assert m["kl_mu_pi"] > 0 and m["entropy"] > 0 and m["grad_norm"] > 0 and m["tokens_per_s"] > 0
    assert m["packing_efficiency"] == pytest.approx(1.0)  # 16-position samples fill 32-position rows
    before, after = weights(tiny_megatron), weights(out / "custom")
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-3


def test_non_finite_loss_skips_the_step_and_keeps_the_weights(stepped, tiny_megatron):
    out, metrics = stepped
    m = metrics["nan"][0]
    assert m["skipped"] and m["skip_reason"].startswith("non-finite loss")
    before, after = weights(tiny_megatron), weights(out / "nan")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_kl_penalty_against_frozen_reference(stepped):
    _, metrics = stepped
    first, second = metrics["kl"]
    assert first["kl_ref"] == 0.0  # policy == reference before the first update
    assert second["kl_ref"] > 0.0 and not second["skipped"]
