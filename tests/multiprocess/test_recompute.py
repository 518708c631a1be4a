"""Activation recomputation (trainer.recompute_*) changes memory, never the numbers.

At TP2 x PP2 the RL step's gradients and the weights after one Adam step with
selective (core attention) and full (uniform and block) recomputation equal the
run without recomputation; each rank's peak of activations held for backward
drops, by what the recomputed parts would have held.
"""

import json

import pytest
import torch

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from megarl.checkpointing.megatron_checkpoint import read_spec
from megarl.models.hf_mapping import tensor_mappings
from tests.conftest import run_ranks
from tests.rl_batch import make_samples, save_samples

pytestmark = pytest.mark.slow

SETTINGS = ["none", "selective", "full-uniform", "full-block"]


def read_all(ckpt_dir):
    reader = DistCheckpointReader(ckpt_dir / "release")
    spec = read_spec(ckpt_dir / "release")
    out = {}
    for m in tensor_mappings(spec):
        for layer in range(spec.num_layers) if m.per_layer else [None]:
            out[(m.megatron_key, layer)] = reader.read(m.megatron_key, layer)
    return out


@pytest.fixture(scope="module")
def runs(tiny_hf, tiny_megatron, tmp_path_factory):
    out = tmp_path_factory.mktemp("recompute")
    samples = out / "samples.pt"
    save_samples(make_samples(tiny_hf, vocab_size=300), samples)
    run_ranks(
        4,
        "recompute_worker.py",
        "--checkpoint",
        tiny_megatron,
        "--samples",
        samples,
        "--out",
        out,
        "--settings",
        *SETTINGS,
    )
    return out


def peaks(runs, setting):
    return [json.loads((runs / f"{setting}-rank{r}.json").read_text())["peak_activation_bytes"] for r in range(4)]


@pytest.mark.parametrize("setting", SETTINGS[1:])
@pytest.mark.parametrize("what", ["grads", "weights"])
def test_recompute_changes_no_number(runs, setting, what):
    base, ours = read_all(runs / "none" / what), read_all(runs / setting / what)
    assert sorted(base) == sorted(ours)
    worst = max(((ours[k] - base[k]).norm() / base[k].norm()).item() for k in base)
    print(f"{setting} {what}: worst relative difference {worst:.2e}")
    assert worst <= 1e-6
    if what == "weights":  # the step moved the weights: equality is not of two untouched copies
        start = read_all(runs / "none" / "grads")
        assert any(not torch.equal(start[k], base[k]) for k in base)


def test_recompute_lowers_each_ranks_peak_activations(runs):
    none, selective = peaks(runs, "none"), peaks(runs, "selective")
    full_uniform, full_block = peaks(runs, "full-uniform"), peaks(runs, "full-block")
    print(
        f"peak activation bytes per rank: none {none}, selective {selective}, full-uniform {full_uniform}, "
        f"full-block {full_block}"
    )
    # Selective recomputation drops core attention's saved tensors. The core attention is SDPA, one
    # causal call per packed sample (megarl/models/sdpa_attention.py): it saves its output and the
    # keys and values expanded to the query heads, [heads/TP = 2, 64 positions, head dim 16] fp32 =
    # 8 KiB each (and the queries, which the checkpoint keeps too), where the checkpoint keeps the
    # un-expanded keys and values (1 group: 4 KiB each) and the [64, 64] bool mask (4 KiB): >= 12 KiB
    # for each of the stage's 2 layers and each micro-batch the 1F1B schedule holds: 2 on the first
    # stage (one warm-up forward), 1 on the last. (A masked SDPA call also saved the mask as fp32,
    # 16 KiB more; Megatron's unfused attention the s x s softmax.)
    in_flight = [2, 2, 1, 1]  # ranks 0, 1: stage 0 (TP ranks 0, 1); ranks 2, 3: stage 1
    for n, s, k in zip(none, selective, in_flight):
        assert n - s >= 2 * k * (3 * 8192 - 3 * 4096)
    # Full recomputation of every layer keeps least; block (1 of the stage's 2 layers) sits between.
    for n, s, u, b in zip(none, selective, full_uniform, full_block):
        assert u < b < n and u < s
