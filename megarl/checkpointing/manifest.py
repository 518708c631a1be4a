"""Checkpoint manifests: every file of a checkpoint directory with its size and CRC-32.

    ITER_DIR/megarl_manifest.json   {"format": 1, "algorithm": "crc32", "files": {path: {size, crc32}}}

Written last into the staging directory, before it is renamed into place
(megatron_checkpoint.save_state), so a directory with a manifest is a
complete save and one whose files disagree with it was damaged afterwards.

Why CRC-32 (zlib's): a 405B training checkpoint is ~5.7 TB. A checksum must
not add minutes to every save. zlib.crc32 runs at ~3 GB/s on one core here
(sha1 1.5, md5 0.6, blake2b 0.7 GB/s), needs no extra package, and releases
the GIL, so a rank's files are summed by a few threads at once. It catches
truncation, zeroed blocks and flipped bits, which is what a manifest is for;
it is no defence against tampering (nothing here is). Each rank sums the
files it wrote itself (``__<rank>_<n>.distcp``, still in its page cache);
rank 0 sums the rest and merges the parts, so a save's cost is 1/N of the
checkpoint per rank. Verification is shared the same way over a process group.

A checkpoint without a manifest (written before megarl kept them) still
loads, with a warning that it cannot be verified.
"""

from __future__ import annotations

import heapq
import json
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megarl.errors import CheckpointError

# torch.distributed is imported where a process group is used: the `megarl train` launcher reads
# checkpoints through this module (model_source.py -> megatron_checkpoint.py) and must not import
# torch (tests/multiprocess/test_launch.py: ~4 s of CPU per launch on 2 cores).

MANIFEST_FILE = "megarl_manifest.json"
PART_PREFIX = ".manifest_part_"  # one per rank in the staging dir, merged by rank 0
FORMAT = 1
ALGORITHM = "crc32"
CHUNK_BYTES = 16 << 20
MAX_THREADS = 4

# checkpoints this process has verified in full: the stat of each file then, per directory
_verified: Dict[str, tuple] = {}
_warned_unverifiable: set = set()


# -- checksums ----------------------------------------------------------------------------------


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def checksum_files(ckpt_dir: Path, names: Sequence[str]) -> Dict[str, dict]:
    """{name: {size, crc32}} of files relative to ``ckpt_dir``, summed by a few threads."""
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(MAX_THREADS, os.cpu_count() or 1, len(names))) as pool:
        crcs = list(pool.map(lambda n: file_crc32(ckpt_dir / n), names))
    return {n: {"size": (ckpt_dir / n).stat().st_size, ALGORITHM: c} for n, c in zip(names, crcs)}


def list_files(ckpt_dir: Path) -> List[str]:
    """Every file below ``ckpt_dir`` (relative, '/'-separated) but the manifest and its parts."""
    out = []
    for dirpath, _, files in os.walk(ckpt_dir):
        for name in files:
            rel = Path(dirpath, name).relative_to(ckpt_dir).as_posix()
            if rel not in (MANIFEST_FILE, MANIFEST_FILE + ".tmp") and not rel.startswith(PART_PREFIX):
                out.append(rel)
    return sorted(out)


def own_files(ckpt_dir: Path, rank: int) -> List[str]:
    """The files this rank wrote: torch_dist names them ``__<global rank>_<n>.distcp``."""
    prefix = f"__{rank}_"
    return sorted(n for n in os.listdir(ckpt_dir) if n.startswith(prefix) and n.endswith(".distcp"))


# -- writing (inside save_state) --------------------------------------------------------------


def write_part(staging: Path, rank: int) -> None:
    """Every rank: sum the files it wrote into ``.manifest_part_<rank>``."""
    start = time.perf_counter()
    files = checksum_files(staging, own_files(staging, rank))
    part = {"files": files, "seconds": time.perf_counter() - start}
    _write_atomic(staging / f"{PART_PREFIX}{rank}", json.dumps(part))


def finish_manifest(staging: Path, world: int, iteration: Optional[int]) -> dict:
    """Rank 0, after every part exists: merge, sum what no part covers, write the manifest.

    Returns {files, bytes, seconds}: ``seconds`` is the slowest rank's summing plus the merge.
    """
    start = time.perf_counter()
    files: Dict[str, dict] = {}
    slowest = 0.0
    for rank in range(world):
        part_file = staging / f"{PART_PREFIX}{rank}"
        part = json.loads(part_file.read_text())
        files.update(part["files"])
        slowest = max(slowest, part["seconds"])
        part_file.unlink()
    present = list_files(staging)
    files.update(checksum_files(staging, [n for n in present if n not in files]))
    stale = sorted(set(files) - set(present))
    if stale:  # a part named a file that is not there: the save itself went wrong
        raise CheckpointError(
            f"{staging}: files summed by a rank are gone before the manifest was written: {stale[:5]}"
        )
    manifest = {
        "format": FORMAT,
        "algorithm": ALGORITHM,
        "iteration": iteration,
        "written_by_ranks": world,
        "files": {n: files[n] for n in present},
    }
    _write_atomic(staging / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True))
    return {
        "files": len(present),
        "bytes": sum(f["size"] for f in files.values()),
        "seconds": slowest + time.perf_counter() - start,
    }


def _write_atomic(path: Path, text: str) -> None:
    """Write-temp-then-rename, flushed to disk first: a crash leaves the old file or the new."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_atomic(path: Path, text: str) -> None:
    _write_atomic(path, text)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- verifying ----------------------------------------------------------------------------------


def read_manifest(ckpt_dir: Path) -> Optional[dict]:
    """The manifest, or None for a checkpoint written before manifests existed."""
    path = Path(ckpt_dir) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("algorithm") != ALGORITHM or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"not a format-{FORMAT} {ALGORITHM} manifest")
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e}); the checkpoint cannot be trusted") from None
    return manifest


def _share(files: Dict[str, dict], rank: int, world: int) -> List[str]:
    """This rank's files to sum: sizes balanced greedily, the same answer on every rank."""
    loads = [(0, r) for r in range(world)]
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        load, r = heapq.heappop(loads)
        if r == rank:
            mine.append(name)
        heapq.heappush(loads, (load + files[name]["size"], r))
    return mine


def checkpoint_problems(ckpt_dir: Path, checksums: bool = True, group=None, reuse: bool = False) -> Optional[List[str]]:
    """What is wrong with a checkpoint's files (empty: nothing); None: it has no manifest.

    With ``group`` (a torch.distributed group every member of which calls this) the
    checksums are shared out over its ranks and every rank gets the same answer.
    ``reuse``: skip the checksums if this process verified the same files (same sizes,
    mtimes and inodes) before: find_resumable_checkpoint and then the load read it once.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        return None
    files = manifest["files"]
    problems = []
    intact, stamp = {}, [_stat_key(ckpt_dir / MANIFEST_FILE)]
    for name in sorted(files):
        want = files[name]
        try:
            st = (ckpt_dir / name).stat()
        except FileNotFoundError:
            problems.append(f"{name}: missing (listed in {MANIFEST_FILE})")
            continue
        stamp.append(_stat_key(ckpt_dir / name, st))
        if st.st_size != want["size"]:
            problems.append(
                f"{name}: {st.st_size} bytes, {MANIFEST_FILE} says {want['size']} "
                f"({'truncated' if st.st_size < want['size'] else 'grown'})"
            )
        else:
            intact[name] = want
    if checksums:
        rank, world = _rank_world(group)
        key = str(ckpt_dir.resolve())
        # every rank joins the gather even with nothing to read, so none waits on another
        mine = [] if reuse and _verified.get(key) == tuple(stamp) else _share(intact, rank, world)
        for name in mine:
            try:
                got = file_crc32(ckpt_dir / name)
            except OSError as e:  # reported, not raised: the other ranks are waiting for this one's answer
                problems.append(f"{name}: unreadable ({e})")
                continue
            if got != intact[name][ALGORITHM]:
                problems.append(f"{name}: CRC-32 {got}, {MANIFEST_FILE} says {intact[name][ALGORITHM]} (corrupt)")
        if world > 1:
            import torch.distributed as dist

            gathered: list = [None] * world
            dist.all_gather_object(gathered, problems, group=group)
            problems = [p for part in gathered for p in part]
        if not problems:
            _verified[key] = tuple(stamp)
    return sorted(set(problems))


def _stat_key(path: Path, st=None) -> tuple:
    st = st or path.stat()
    return path.name, st.st_size, st.st_mtime_ns, st.st_ino


def _rank_world(group) -> tuple:
    """This process's rank in ``group`` and its size, asked of the group itself: megarl's control
    group is built outside the default world (rendezvous.py), whose ranks dist.get_rank(group)
    would translate wrongly."""
    if group is None:
        return 0, 1
    return group.rank(), group.size()


def describe(problems: List[str], limit: int = 3) -> str:
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def verify_checkpoint(
    ckpt_dir: os.PathLike, checksums: bool = True, group=None, what: str = "checkpoint", reuse: bool = False
) -> bool:
    """Raise CheckpointError naming the files that disagree with the manifest.

    True: verified (sizes, and CRC-32s if ``checksums``); False: no manifest to check
    against (warned once per directory).
    """
    ckpt_dir = Path(ckpt_dir)
    problems = checkpoint_problems(ckpt_dir, checksums, group, reuse)
    if problems is None:
        warn_unverifiable(ckpt_dir)
        return False
    if problems:
        raise CheckpointError(f"{what} {ckpt_dir} is damaged: {describe(problems)}")
    return True


def warn_unverifiable(ckpt_dir: Path) -> None:
    key = str(Path(ckpt_dir).resolve())
    if key in _warned_unverifiable or not _is_first_rank():
        return
    _warned_unverifiable.add(key)
    print(
        f"megarl: warning: {ckpt_dir} has no {MANIFEST_FILE} (written before megarl kept manifests): "
        f"its files cannot be verified",
        file=sys.stderr,
        flush=True,
    )


def _is_first_rank() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return True
    return not dist.is_initialized() or dist.get_rank() == 0
