"""The AIPO gradient through Megatron (schedule, DDP, vocab-parallel log-probs, packing)
equals a plain PyTorch reference on transformers' model, at every layout and
however the batch is split into micro-batches."""

import json

import pytest

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from megarl.checkpointing.megatron_checkpoint import read_spec
from megarl.models.hf_mapping import tensor_mappings, to_hf
from tests.conftest import run_ranks
from tests.rl_batch import make_samples, reference_aipo_grads, save_samples

pytestmark = pytest.mark.slow

SINGLE = ["1x1:128", "1x1:64", "1x1:32"]  # 1, 2 and 4 micro-batches
WORLD4 = ["2x1:32", "1x2:32", "2x2:64", "1x2x2:32", "1x1:16"]  # TP2.DP2, PP2.DP2, TP2xPP2, VP, DP4


def megatron_grads_as_hf(ckpt_dir):
    reader = DistCheckpointReader(ckpt_dir / "release")
    spec = read_spec(ckpt_dir / "release")
    grads = {}
    for m in tensor_mappings(spec):
        for layer in range(spec.num_layers) if m.per_layer else [None]:
            grads.update(to_hf(m, spec, reader.read(m.megatron_key, layer), layer))
    return grads


@pytest.fixture(scope="module")
def batch(tiny_hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "samples.pt"
    samples = make_samples(tiny_hf, vocab_size=300)
    save_samples(samples, path)
    return samples, path


@pytest.fixture(scope="module")
def reference(tiny_hf, batch):
    return reference_aipo_grads(tiny_hf, batch[0])


@pytest.fixture(scope="module")
def megatron_runs(tiny_megatron, batch, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_grads")
    common = ["--checkpoint", tiny_megatron, "--samples", batch[1], "--out", out]
    run_ranks(1, "rl_grad_worker.py", *common, "--runs", *SINGLE)
    run_ranks(4, "rl_grad_worker.py", *common, "--runs", *WORLD4)
    return out


@pytest.mark.parametrize("run", SINGLE + WORLD4)
def test_aipo_gradient_matches_transformers_reference(run, megatron_runs, reference):
    ref_grads, ref_loss = reference
    name = run.replace(":", "_")
    record = json.loads((megatron_runs / f"{name}.json").read_text())
    ours = megatron_grads_as_hf(megatron_runs / name)
    assert sorted(ours) == sorted(ref_grads)
    assert record["clipped"] > 0  # the batch exercises the clip
    assert abs(record["loss_sum"] / record["tokens"] - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    # Relative error of the whole gradient, and of the worst single tensor (small
    # tensors carry fp32 rounding of a few 1e-6 on both sides).
    diff_sq = sum(((ours[k] - ref) ** 2).sum().item() for k, ref in ref_grads.items())
    ref_sq = sum((ref**2).sum().item() for ref in ref_grads.values())
    overall = (diff_sq / ref_sq) ** 0.5
    worst = max(((ours[k] - ref).norm() / ref.norm()).item() for k, ref in ref_grads.items())
    print(f"{run}: {record['micro_batches']} micro-batches, relative gradient error {overall:.2e} "
          f"(worst tensor {worst:.2e})")
    assert overall <= 1e-5 and worst <= 2e-5


def test_micro_batch_counts(megatron_runs):
    counts = [json.loads((megatron_runs / f"{r.replace(':', '_')}.json").read_text())["micro_batches"] for r in SINGLE]
    assert counts == [1, 2, 4]
