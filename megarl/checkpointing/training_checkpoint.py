"""Training checkpoints: model weights, distributed-optimizer state and loop state.

Same directory layout as model checkpoints (megatron_checkpoint), plus the
optimizer under 'optimizer' in Megatron's 'fully_reshardable' format, so a run
can resume at a different TP/PP/DP. ('dp_reshardable', the 0.16.1 default
alternative, pins the DP layout; the default 'fully_sharded_model_space'
raises "flattened_range is not supported" with this version's torch_dist.)

A resuming job picks its checkpoint with resume.find_resumable_checkpoint
(the newest whose files match their manifest) and passes that iteration
directory here; a root (with the tracker) loads the tracker's iteration.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megarl.checkpointing.megatron_checkpoint import (
    load_model_state,
    model_sharded_state_dict,
    resolve_checkpoint_dir,
    save_state,
)
from megarl.models.spec import ModelSpec
from megatron_patches import optimizer_state

OPTIMIZER_SHARDING = "fully_reshardable"


def _optimizer_sharded_state_dict(optimizer, model_state: dict, is_loading: bool) -> dict:
    # sharded_state_dict(metadata=d) mutates d in place: always pass a fresh dict.
    metadata = {"distrib_optim_sharding_type": OPTIMIZER_SHARDING}
    return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)


def save_training_state(
    chunks: List[torch.nn.Module],
    optimizer,
    root: os.PathLike,
    spec: ModelSpec,
    iteration: int,
    loop_state: Optional[Dict[str, Any]] = None,
    tokenizer_files: Sequence[Path] = (),
    keep_checkpoints: int = 0,
) -> Path:
    """Collective save. ``loop_state`` must be identical on every rank (rank 0 writes it).

    ``keep_checkpoints`` (run.keep_checkpoints) > 0: afterwards only that many newest remain.
    """
    state = model_sharded_state_dict(chunks)
    state["optimizer"] = _optimizer_sharded_state_dict(optimizer, state, is_loading=False)
    state["loop_state"] = dict(loop_state or {})
    return save_state(state, root, spec, iteration, tokenizer_files, keep=keep_checkpoints)


def load_training_state(
    chunks: List[torch.nn.Module], optimizer, path: os.PathLike, verify: str = "checksums_once"
) -> Dict[str, Any]:
    """Load weights and optimizer state saved at any layout; return the loop state.

    ``path``: a root (its tracker's iteration) or one iteration directory. Collective over the
    default group, which shares out the checksums (none are read again for a directory this
    process already verified, e.g. with find_resumable_checkpoint); a file that does not
    match the manifest raises CheckpointError naming it.
    """
    ckpt_dir = resolve_checkpoint_dir(
        path, what="checkpoint", verify=verify, group=dist.group.WORLD if dist.is_initialized() else None
    )
    state = model_sharded_state_dict(chunks)
    optimizer_state.apply()
    optimizer_state.init_adam_state_for_loading(optimizer)
    state["optimizer"] = _optimizer_sharded_state_dict(optimizer, state, is_loading=True)
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    load_model_state(chunks, loaded, ckpt_dir)
    optimizer.load_state_dict(loaded["optimizer"])
    # the loaded param groups carry the saving run's settings: the caller applies this machine's
    # again (trainer.setup.fuse_torch_adam_on_cpu)
    optimizer_state.untie_adam_step_state(optimizer)
    return dict(loaded.get("loop_state", {}), iteration=loaded.get("iteration", 0))
