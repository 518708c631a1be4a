"""Which checkpoint a relaunched job resumes from, and which old ones it may delete.

A training run's ROOT holds iter_XXXXXXX/ directories, each renamed into place
only when complete with its manifest (megatron_checkpoint.save_state). A
relaunch resumes from the newest one whose files match their manifest; each
newer one passed over is reported with the file at fault, so an operator
knows why the job went back. Nothing is deleted here: a damaged checkpoint
stays for inspection (the next save of that iteration replaces it).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from megarl.checkpointing.manifest import checkpoint_problems, describe, warn_unverifiable
from megarl.errors import CheckpointError

ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
STAGING_PREFIX = ".incomplete_"  # save_state's staging directories
DELETING_PREFIX = ".deleting_"  # a pruned checkpoint on its way out: never looks like one


@dataclass
class ResumableCheckpoint:
    path: Path  # the iteration directory: load_training_state(chunks, optimizer, path) loads it
    iteration: int
    verified: bool  # False: written before manifests, loaded unverified
    skipped: List[str] = field(default_factory=list)  # newer checkpoints passed over, each with why


def list_iterations(root: os.PathLike) -> List[Tuple[int, Path]]:
    """(iteration, directory) of every iter_XXXXXXX under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in os.listdir(root):
        m = ITERATION_DIR.match(entry)
        if m and (root / entry).is_dir():
            found.append((int(m.group(1)), root / entry))
    return sorted(found)


def find_resumable_checkpoint(root: os.PathLike, group=None, report: bool = True) -> Optional[ResumableCheckpoint]:
    """The newest checkpoint under ``root`` whose files match its manifest; None if there is none.

    Raises CheckpointError when checkpoints exist but none is usable (starting afresh would
    overwrite them). ``group``: a torch.distributed group whose members all call this; they
    share the checksumming and get the same answer. ``report``: its first rank prints a warning
    for each checkpoint passed over.
    """
    root = Path(root)
    candidates = _broadcast(list_iterations(root), group)
    skipped: List[str] = []
    for iteration, path in reversed(candidates):
        try:
            problems = checkpoint_problems(path, checksums=True, group=group)
        except CheckpointError as e:  # an unreadable manifest: as damaged as a bad file
            problems = [str(e)]
        if problems:
            skipped.append(f"{path} is damaged: {describe(problems)}")
            continue
        point = ResumableCheckpoint(path, iteration, verified=problems is not None, skipped=skipped)
        if report and _first_rank(group):
            for why in skipped:
                print(f"megarl: warning: not resuming from {why}", file=sys.stderr, flush=True)
            if skipped:
                print(
                    f"megarl: warning: resuming from the previous complete checkpoint {path} (iteration {iteration})",
                    file=sys.stderr,
                    flush=True,
                )
            if not point.verified:
                warn_unverifiable(path)
        return point
    if skipped:
        raise CheckpointError(
            f"{root}: no checkpoint there is intact, so the run cannot resume: "
            f"{' | '.join(skipped)}. Move the damaged ones away (or the whole "
            f"directory, to start afresh)"
        )
    return None


def resumable_checkpoint_dir(root: os.PathLike, group=None) -> Optional[Path]:
    """find_resumable_checkpoint's directory (warnings printed), for a one-line caller."""
    point = find_resumable_checkpoint(root, group)
    return point.path if point is not None else None


def prune_checkpoints(root: os.PathLike, keep: int, newest: int) -> List[Path]:
    """Keep the ``keep`` newest complete checkpoints up to iteration ``newest`` (just saved).

    Called after ``newest`` is complete, so the one a job resumed from is deleted only once a
    newer one exists. Complete = the files have the manifest's sizes (a cheap check; legacy
    checkpoints without a manifest count as complete). Checkpoints newer than ``newest`` (a
    damaged one a job fell back from) are never touched. Also removes stale staging dirs.
    """
    root = Path(root)
    for entry in os.listdir(root):  # interrupted saves and deletions: never resumable
        if entry.startswith((STAGING_PREFIX, DELETING_PREFIX)) and (root / entry).is_dir():
            shutil.rmtree(root / entry, ignore_errors=True)
    if keep <= 0:
        return []
    kept, deleted = 0, []
    for iteration, path in reversed(list_iterations(root)):
        if iteration > newest:
            continue
        if kept >= keep:
            trash = root / f"{DELETING_PREFIX}{path.name}"
            os.replace(path, trash)  # one rename: a crash mid-delete leaves no half checkpoint
            shutil.rmtree(trash)
            deleted.append(path)
            continue
        try:
            complete = not checkpoint_problems(path, checksums=False)
        except CheckpointError:
            complete = False
        kept += complete
    return deleted


def _first_rank(group) -> bool:
    return group is None or group.rank() == 0  # the group's own rank (see manifest._rank_world)


def _broadcast(value, group):
    """The first rank's listing for all: every rank must check the same candidates in step."""
    if group is None or group.size() == 1:
        return value
    # imported here: torch.distributed costs ~1.4 s and only ranks of a group broadcast; `megarl train`'s
    # torch-free launcher imports this module (via megatron_checkpoint and checkpointing.recorded)
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
