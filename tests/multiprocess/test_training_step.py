"""One training step through Megatron's own schedule, DDP and distributed optimizer
gives the same loss, gradient norm and updated weights at every layout as at TP1,
and a run reloaded from a training checkpoint continues exactly like an unbroken one."""

import json

import pytest

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from tests.conftest import run_ranks

pytestmark = pytest.mark.slow

# In a world of 4: TP2 x PP2 (DP1); TP2 (DP2); PP2 (DP2); PP2 with 2 virtual stages (DP2); DP4.
LAYOUTS = ["2x2", "2x1", "1x2", "1x2x2", "1x1"]
VOCAB = 300


def max_weight_diff(a_dir, b_dir) -> float:
    a, b = DistCheckpointReader(a_dir / "release"), DistCheckpointReader(b_dir / "release")
    worst = 0.0
    for key in a.metadata.state_dict_metadata:
        if not key.startswith(("embedding", "decoder", "output")):
            continue
        x, y = a.read(key), b.read(key)
        if key.startswith(("embedding", "output")):  # padded vocabulary differs with TP
            x, y = x[:VOCAB], y[:VOCAB]
        worst = max(worst, (x - y).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def trained(tiny_megatron, tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    (out / "reference").mkdir()
    run_ranks(1, "train_step_worker.py", "--checkpoint", tiny_megatron, "--out", out / "reference", "--layouts", "1x1")
    run_ranks(4, "train_step_worker.py", "--checkpoint", tiny_megatron, "--out", out, "--layouts", *LAYOUTS)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_matches_tp1(layout, trained, tiny_megatron):
    reference = json.loads((trained / "reference" / "1x1.json").read_text())
    ours = json.loads((trained / f"{layout}.json").read_text())
    for ref_step, our_step in zip(reference, ours):
        assert abs(our_step["loss"] - ref_step["loss"]) <= 1e-5
        assert abs(our_step["grad_norm"] - ref_step["grad_norm"]) <= 1e-5
    diff = max_weight_diff(trained / layout, trained / "reference" / "1x1")
    moved = max_weight_diff(trained / "reference" / "1x1", tiny_megatron)
    print(f"{layout}: loss {ours[0]['loss']:.6f}, max |w - w_TP1| = {diff:.2e} (update size {moved:.2e})")
    assert moved > 1e-2  # the step really changed the weights
    assert diff <= 1e-5


def test_resume_continues_like_an_unbroken_run(tiny_megatron, tmp_path):
    run_ranks(
        4,
        "resume_worker.py",
        "--checkpoint",
        tiny_megatron,
        "--out",
        tmp_path,
        "--save-layout",
        "2x1",
        "--resume-layouts",
        "2x1",
        "1x2",
    )
    records = json.loads((tmp_path / "records.json").read_text())
    for layout in ("2x1", "1x2"):
        assert records[f"loop_state_{layout}"] == {"policy_version": 1, "iteration": 1}
        for unbroken, resumed in zip(records["unbroken"], records[f"resumed_{layout}"]):
            assert abs(unbroken["loss"] - resumed["loss"]) <= 1e-6
        # torch Adam: every parameter has its own step counter, at 1 + 2 steps.
        steps = records[f"adam_steps_{layout}"]
        assert steps["values"] == [3.0] and steps["distinct_objects"] == steps["n"]
        diff = max_weight_diff(tmp_path / f"resumed_{layout}", tmp_path / "unbroken")
        print(f"resumed at {layout}: max |w - w_unbroken| = {diff:.2e}")
        assert diff <= (1e-7 if layout == "2x1" else 1e-5)
