"""Routed experts in rollouts.jsonl: written compactly by the loop's rollout log, read back by
`megarl train --replay` as the tensors the generator recorded."""

import json

import pytest
import torch

from megarl.errors import ConfigError
from megarl.loop.records import log_rollouts
from megarl.loop.replay import load_recorded_batches
from megarl.loop.routes_json import decode_routes, encode_routes
from megarl.rollout import Sample


def _routes(positions, experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    routes = torch.randint(0, experts, (positions, 3, 2), generator=g).to(torch.int16)
    routes[:, 0] = -1  # a dense layer
    return routes


@pytest.mark.parametrize("experts, width", [(128, 1), (256, 2)])  # Qwen3-235B's 128; DeepSeek-V3's 256
def test_routes_round_trip_at_one_byte_when_ids_fit(experts, width):
    routes = _routes(40, experts)
    routes[5, 1, 0] = experts - 1  # the largest id must survive
    value = encode_routes(routes)
    assert len(value["base64"]) == pytest.approx(4 * routes.numel() * width / 3, abs=4)
    back = decode_routes(json.loads(json.dumps(value)), "x")
    assert back.dtype == torch.int16 and torch.equal(back, routes)
    assert encode_routes(None) is None and decode_routes(None, "x") is None


def test_rollouts_jsonl_carries_routes_to_replay(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    with_routes = Sample([1, 2, 3], [4, 5], [-0.5, -0.25], [1, 1], reward=1.0, routed_experts=_routes(4, 4))
    without = Sample([1, 2], [6], [-0.1], [1], reward=0.0, group_id=1)
    log_rollouts(path, 1, 1, [with_routes, without])
    (step,) = load_recorded_batches(path).values()
    a, b = step["samples"]
    assert torch.equal(a.routed_experts, with_routes.routed_experts) and b.routed_experts is None
    line = json.loads(path.read_text().splitlines()[0])
    line["routed_experts"]["base64"] = "!!"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ConfigError, match=r"rollouts.jsonl:1: routed_experts is not"):
        load_recorded_batches(path)
