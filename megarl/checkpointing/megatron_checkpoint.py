"""Megatron dist checkpoints (torch_dist) of a Llama model, in Megatron-LM's layout.

    ROOT/latest_checkpointed_iteration.txt   "release" or the last iteration
    ROOT/release/ or ROOT/iter_0000100/      one dist checkpoint:
        metadata.json, .metadata, *.distcp, common.pt   (Megatron-Core)
        megarl_model.json                                (the ModelSpec)
        tokenizer/                                       (HF tokenizer files)
        megarl_manifest.json                             (every file's size and CRC-32)

Tensors are stored by Megatron's canonical keys as global tensors, so a
checkpoint saved at one TP/PP loads at any other (Megatron reshards on load;
vocabulary padding differences are absorbed by its allow_shape_mismatch on the
embedding and output layer). A save goes to a temporary directory that is
renamed into place only when complete with its manifest, and the tracker is
rewritten (temp file, rename) only after that, so an interrupted save never
replaces a good checkpoint. Loading checks the files against the manifest
(manifest.py): sizes always, CRC-32s where asked.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence

from megarl.checkpointing import manifest
from megarl.checkpointing.resume import prune_checkpoints
from megarl.errors import CheckpointError
from megarl.models.spec import ModelSpec
from megarl.runtime.cpu_memory import release_freed_memory

if TYPE_CHECKING:  # torch is imported where a checkpoint is saved or loaded: `megarl train`'s launcher
    import torch  # reads only the names and the spec (model_source.prepare_model)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
SPEC_FILE = "megarl_model.json"
TOKENIZER_DIR = "tokenizer"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's version tag for dist checkpoints


def iteration_dir_name(iteration: Optional[int]) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def resolve_checkpoint_dir(path: os.PathLike, what: str = "--megatron", verify: str = "sizes", group=None) -> Path:
    """The dist-checkpoint directory for a root (with a tracker file) or the directory itself.

    ``verify``: ``sizes`` (every file the manifest lists is there at its size: cheap, on every
    load), ``checksums`` (and its CRC-32 matches: reads the whole checkpoint, shared out over
    ``group``'s ranks if given), ``checksums_once`` (the same unless this process already
    verified these very files) or ``none``. A mismatch raises CheckpointError naming the file.
    """
    # imported here: Megatron-Core's dist_checkpointing costs ~2.4 s (torch with it); `megarl train`'s
    # launcher imports this module for its names and read_spec, and stays torch-free (model_source.py)
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{what} {path}: no such file or directory")
    tracker = path / TRACKER_FILE
    if tracker.exists():
        tag = tracker.read_text(errors="replace").strip()
        if tag != "release" and not tag.isdigit():  # Megatron-LM writes "release" or the iteration
            raise CheckpointError(
                f"{what}: {tracker} holds {tag[:80]!r}, expected 'release' or an iteration number "
                f"(the file names the checkpoint to load; Megatron-LM and megarl write it)"
            )
        path = path / (tag if tag == "release" else iteration_dir_name(int(tag)))
        if not path.is_dir():
            raise CheckpointError(f"{what}: {tracker} points to {path}, which does not exist")
    if not path.is_dir() or not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        raise CheckpointError(
            f"{what} {path}: not a Megatron dist checkpoint (no metadata.json); expected a directory "
            f"written by tools/convert_hf_to_megatron.py or by megarl training"
        )
    if verify not in ("none", "sizes", "checksums", "checksums_once"):
        raise ValueError(f"verify={verify!r}")
    if verify != "none":
        manifest.verify_checkpoint(
            path, checksums=verify != "sizes", group=group, what=what, reuse=verify == "checksums_once"
        )
    return path


def read_spec(ckpt_dir: os.PathLike) -> ModelSpec:
    spec_file = Path(ckpt_dir) / SPEC_FILE
    if not spec_file.exists():
        raise CheckpointError(f"{ckpt_dir}: no {SPEC_FILE}; this Megatron checkpoint was not written by megarl")
    return ModelSpec.load(spec_file)


# -- sharded state dicts --------------------------------------------------------------------


def model_sharded_state_dict(chunks: List[torch.nn.Module]) -> Dict[str, dict]:
    """Megatron-LM's structure: {'model': ...} or {'model0': ..., 'model1': ...} with VP.

    ``_extra_state`` entries (Transformer Engine's fp8 metadata, empty for the
    local spec) are left out: they are layout-specific and would stop a TE
    model and a local model from loading each other's weights.
    """
    out = {}
    for i, chunk in enumerate(chunks):
        sd = chunk.sharded_state_dict()
        sd = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
        out["model" if len(chunks) == 1 else f"model{i}"] = sd
    return out


def iter_sharded_tensors(sharded_state_dict) -> Iterator:
    """Every ShardedTensor of a sharded state dict, with factories (fc1's swiglu) built."""
    # imported here: Megatron-Core, kept out of this module's import (resolve_checkpoint_dir's note)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory):
            yield from (t for t in nested_values(value.build()) if isinstance(t, ShardedTensor))
        elif isinstance(value, ShardedTensor):
            yield value


# -- save / load ----------------------------------------------------------------------------


def save_model(
    chunks: List[torch.nn.Module],
    root: os.PathLike,
    spec: ModelSpec,
    iteration: Optional[int] = None,
    tokenizer_files: Sequence[Path] = (),
) -> Path:
    """Save this rank's model chunks (collective over the world); return the checkpoint dir."""
    return save_state(model_sharded_state_dict(chunks), root, spec, iteration, tokenizer_files)


def save_state(
    state: dict,
    root: os.PathLike,
    spec: ModelSpec,
    iteration: Optional[int] = None,
    tokenizer_files: Sequence[Path] = (),
    keep: int = 0,
) -> Path:
    """Save a sharded state dict as ROOT/<iteration dir>, atomically, with its manifest; update the tracker.

    ``tokenizer_files`` (rank 0's list counts) are copied into ``tokenizer/``. ``keep`` > 0:
    then delete all but the ``keep`` newest complete iteration checkpoints (resume.prune_checkpoints).
    """
    # imported here: torch and Megatron-Core (~2.4 s), kept out of this module's import
    # (resolve_checkpoint_dir's note); checkpoint_writer patches Megatron-Core, so it imports it too
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_patches import checkpoint_writer

    checkpoint_writer.apply()  # its helper process must not outlive a killed rank
    start = time.perf_counter()
    root = Path(root)
    final = root / iteration_dir_name(iteration)
    staging = root / f".incomplete_{final.name}"
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    dist.barrier()
    state = dict(state, checkpoint_version=CHECKPOINT_VERSION, iteration=iteration or 0)
    dist_checkpointing.save(state, str(staging))
    dist.barrier()
    if rank == 0:
        spec.save(staging / SPEC_FILE)
        if tokenizer_files:
            (staging / TOKENIZER_DIR).mkdir()
            for path in tokenizer_files:
                shutil.copy2(path, staging / TOKENIZER_DIR / Path(path).name)
    manifest.write_part(staging, rank)  # each rank sums what it wrote, while it is in its page cache
    dist.barrier()
    if rank == 0:
        summary = manifest.finish_manifest(staging, world, iteration)
        _publish(staging, final, root, iteration)
        if iteration is not None:
            for path in prune_checkpoints(root, keep, iteration):
                print(f"megarl: deleted checkpoint {path} (run.keep_checkpoints={keep})", file=sys.stderr, flush=True)
        print(
            f"megarl: checkpoint {final} complete: {summary['files']} files, {summary['bytes'] / 2**30:.3f} GiB "
            f"in {time.perf_counter() - start:.2f} s, of which the manifest (CRC-32) {summary['seconds']:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    dist.barrier()
    release_freed_memory()  # the save's buffers, kept by a CPU run's allocator, go back to the kernel
    return final


def _publish(staging: Path, final: Path, root: Path, iteration: Optional[int]) -> None:
    """Rename the complete staging dir into place, then point the tracker at it."""
    old = None
    if final.exists():  # the same iteration saved again (a job that fell back from a damaged one)
        old = root / f".deleting_{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    manifest.fsync_dir(root)
    manifest.write_atomic(root / TRACKER_FILE, "release\n" if iteration is None else f"{iteration}\n")
    if old is not None:
        shutil.rmtree(old)


def load_model(chunks: List[torch.nn.Module], path: os.PathLike) -> Path:
    """Load weights into this rank's chunks from a checkpoint saved at any layout."""
    # imported here: Megatron-Core, kept out of this module's import (resolve_checkpoint_dir's note)
    from megatron.core import dist_checkpointing

    ckpt_dir = resolve_checkpoint_dir(path)
    state = model_sharded_state_dict(chunks)
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    load_model_state(chunks, loaded, ckpt_dir)
    return ckpt_dir


def load_model_state(chunks: List[torch.nn.Module], loaded: dict, ckpt_dir: Path) -> None:
    """Copy loaded 'model' / 'modelN' entries into the chunks, checking nothing is missing."""
    names = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for name, chunk in zip(names, chunks):
        result = chunk.load_state_dict(loaded[name], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise CheckpointError(
                f"{ckpt_dir}: weights do not match the model (missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]})"
            )
