"""init_megatron re-initialised for layout after layout leaves no process groups behind."""

import json
import sys

from tests.conftest import run_command

CODE = """
import json
import torch.distributed.distributed_c10d as c10d
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims
init_distributed()
counts = []
for _ in range(3):
    init_megatron(world_dims(1, 1))
    counts.append(len(c10d._world.pg_map))
shutdown()
print(json.dumps(counts))
"""


def test_reinitialising_megatron_destroys_the_previous_layouts_groups():
    # Megatron's destroy_model_parallel forgets its groups but torch keeps them: without
    # init_megatron's cleanup each re-initialisation added Megatron's 17 groups again (21, 38, 55)
    # (8 gloo ranks slowed up to ~50x per weight-sync round after 12 layouts).
    counts = json.loads(run_command([sys.executable, "-c", CODE]).stdout.strip().splitlines()[-1])
    assert counts[0] > 1  # the world group and Megatron's
    assert counts == [counts[0]] * 3, counts
