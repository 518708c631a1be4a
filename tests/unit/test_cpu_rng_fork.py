"""On CPU, Megatron's RNG tracker forks the CPU generator itself (megatron_patches/cpu_backend.py):
a draw inside a fork comes from the tracker's state, the state outside is restored afterwards, and
fork()'s GPU-only warning about the CPU state changing is not logged."""

import logging

import torch
from megatron.core.tensor_parallel import random as mcore_random

import megatron_patches


def test_fork_draws_from_the_tracker_state_restores_the_default_and_logs_nothing(caplog):
    megatron_patches.apply_cpu_backend()
    tracker = mcore_random.CudaRNGStatesTracker()
    tracker.add("expert-parallel-rng", 99)
    torch.manual_seed(5)
    outside = torch.rand(3)  # what the default generator gives next, without the fork
    torch.manual_seed(5)
    with caplog.at_level(logging.WARNING, logger=mcore_random.__name__):
        with tracker.fork("expert-parallel-rng"):
            inside = torch.rand(3)
        after = torch.rand(3)
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(99)))
    assert torch.equal(after, outside)  # the default generator's state came back
    assert not [r for r in caplog.records if "CPU RNG state changed" in r.getMessage()]
