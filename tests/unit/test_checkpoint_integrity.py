"""Checkpoint integrity: manifests (sizes + CRC-32), verification naming the file at fault, the
fallback to the previous complete checkpoint, run.keep_checkpoints, and end to end: a truncated
file in the latest checkpoint of a `megarl train` run, then `megarl eval` / the converter on it
and a relaunch.

The fast tests build checkpoint directories of random bytes with the names torch_dist gives
its files (``__<rank>_<n>.distcp``, ``.metadata``, ...) and write their manifests with the same
functions save_state calls, once per simulated rank. The CRC-32s are checked against a
table-driven CRC-32 written out here (the IEEE 802.3 polynomial), not zlib.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megarl.checkpointing import manifest
from megarl.checkpointing.manifest import MANIFEST_FILE, checkpoint_problems, verify_checkpoint
from megarl.checkpointing.megatron_checkpoint import TRACKER_FILE, resolve_checkpoint_dir
from megarl.checkpointing.resume import find_resumable_checkpoint, list_iterations, prune_checkpoints
from megarl.errors import CheckpointError


def _crc32_reference(data: bytes) -> int:
    """CRC-32 (reflected, polynomial 0xEDB88320, init and final xor 0xFFFFFFFF), byte by byte."""
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _fake_checkpoint(path: Path, world: int = 2, seed: int = 0, iteration: int = 1) -> dict:
    """A directory laid out like a torch_dist save by ``world`` ranks, its manifest written as
    save_state writes it (a part per rank, then rank 0's merge). Returns {name: bytes}."""
    import random

    rng = random.Random(seed)
    path.mkdir(parents=True)
    contents = {f"__{r}_{n}.distcp": rng.randbytes(rng.randrange(5_000, 40_000)) for r in range(world) for n in (0, 1)}
    contents.update(
        {
            ".metadata": rng.randbytes(3000),
            "common.pt": rng.randbytes(700),
            "metadata.json": json.dumps(
                {
                    "sharded_backend": "torch_dist",
                    "sharded_backend_version": 1,
                    "common_backend": "torch",
                    "common_backend_version": 1,
                }
            ).encode(),
            "megarl_model.json": b"{}",
            "tokenizer/tokenizer.json": rng.randbytes(1000),
        }
    )
    for name, data in contents.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    for rank in range(world):
        manifest.write_part(path, rank)
    manifest.finish_manifest(path, world, iteration)
    return contents


def _training_root(root: Path, iterations, legacy=()) -> None:
    for i in iterations:
        _fake_checkpoint(root / f"iter_{i:07d}", seed=i, iteration=i)
        if i in legacy:
            (root / f"iter_{i:07d}" / MANIFEST_FILE).unlink()
    (root / TRACKER_FILE).write_text(f"{max(iterations)}\n")


def _flip_byte(path: Path, offset: int = 1234) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_its_size_and_crc32(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "CHUNK_BYTES", 4096)  # several chunks per file: the running CRC
    ckpt = tmp_path / "iter_0000001"
    contents = _fake_checkpoint(ckpt, world=3)
    m = json.loads((ckpt / MANIFEST_FILE).read_text())
    assert m["algorithm"] == "crc32" and m["written_by_ranks"] == 3 and m["iteration"] == 1
    assert sorted(m["files"]) == sorted(contents)  # every file (subdirectories too), nothing else
    for name, data in contents.items():
        assert m["files"][name] == {"size": len(data), "crc32": f"{_crc32_reference(data):08x}"}, name
    assert not [p for p in os.listdir(ckpt) if p.startswith(manifest.PART_PREFIX)]  # parts merged away
    assert verify_checkpoint(ckpt) is True


def test_each_rank_sums_only_the_files_it_wrote(tmp_path):
    ckpt = tmp_path / "ckpt"
    _fake_checkpoint(ckpt, world=3)
    (ckpt / MANIFEST_FILE).unlink()
    manifest.write_part(ckpt, 1)
    part = json.loads((ckpt / f"{manifest.PART_PREFIX}1").read_text())
    assert sorted(part["files"]) == ["__1_0.distcp", "__1_1.distcp"]


def test_missing_truncated_and_flipped_files_are_named(tmp_path):
    ckpt = tmp_path / "iter_0000001"
    contents = _fake_checkpoint(ckpt)
    (ckpt / "__1_0.distcp").unlink()
    size = len(contents["__0_1.distcp"])
    with open(ckpt / "__0_1.distcp", "r+b") as f:
        f.truncate(size - 100)
    _flip_byte(ckpt / "tokenizer" / "tokenizer.json", 10)
    problems = checkpoint_problems(ckpt)
    assert problems == [
        f"__0_1.distcp: {size - 100} bytes, {MANIFEST_FILE} says {size} (truncated)",
        f"__1_0.distcp: missing (listed in {MANIFEST_FILE})",
        f"tokenizer/tokenizer.json: CRC-32 "
        f"{_crc32_reference((ckpt / 'tokenizer' / 'tokenizer.json').read_bytes()):08x}, {MANIFEST_FILE} says "
        f"{_crc32_reference(contents['tokenizer/tokenizer.json']):08x} (corrupt)",
    ]
    with pytest.raises(CheckpointError, match=r"checkpoint .*iter_0000001 is damaged: __0_1.distcp: .*truncated"):
        verify_checkpoint(ckpt)
    # sizes only (every load's check) misses the flipped byte, not the other two
    assert len(checkpoint_problems(ckpt, checksums=False)) == 2


def test_one_flipped_byte_in_a_large_file_is_found(tmp_path):
    ckpt = tmp_path / "iter_0000001"
    _fake_checkpoint(ckpt)
    assert checkpoint_problems(ckpt) == []
    _flip_byte(ckpt / "__1_1.distcp", offset=4999)
    with pytest.raises(
        CheckpointError,
        match=r"__1_1.distcp: CRC-32 [0-9a-f]{8}, megarl_manifest.json says "
        r"[0-9a-f]{8} \(corrupt\)",
    ):
        verify_checkpoint(ckpt, what="--checkpoint")


def test_unreadable_manifest_and_legacy_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "iter_0000001"
    _fake_checkpoint(ckpt)
    (ckpt / MANIFEST_FILE).write_text('{"algorithm": "crc32", "files": ')  # cut short
    with pytest.raises(CheckpointError, match=f"{MANIFEST_FILE}: unreadable manifest"):
        verify_checkpoint(ckpt)
    (ckpt / MANIFEST_FILE).unlink()  # as written before manifests existed: loads, with a warning
    assert verify_checkpoint(ckpt) is False
    err = capsys.readouterr().err
    assert f"{ckpt} has no megarl_manifest.json" in err and "cannot be verified" in err
    assert verify_checkpoint(ckpt) is False
    assert capsys.readouterr().err == ""  # warned once per directory


def test_resolve_checkpoint_dir_checks_the_tracker_s_iteration(tmp_path):
    root = tmp_path / "checkpoints"
    _training_root(root, [1, 2])
    assert resolve_checkpoint_dir(root, what="--checkpoint") == root / "iter_0000002"
    with open(root / "iter_0000002" / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=r"--checkpoint .*iter_0000002 is damaged: __0_0.distcp: 10 bytes"):
        resolve_checkpoint_dir(root, what="--checkpoint")
    assert (
        resolve_checkpoint_dir(root / "iter_0000001", what="--checkpoint", verify="checksums") == root / "iter_0000001"
    )


def test_a_load_after_find_resumable_reads_the_files_once_unless_they_changed(tmp_path, monkeypatch):
    ckpt = tmp_path / "iter_0000001"
    _fake_checkpoint(ckpt)
    read = []
    real = manifest.file_crc32
    monkeypatch.setattr(manifest, "file_crc32", lambda p: read.append(Path(p).name) or real(p))
    assert checkpoint_problems(ckpt) == [] and len(read) == 9
    assert checkpoint_problems(ckpt, reuse=True) == [] and len(read) == 9  # verified by this process: not read
    assert checkpoint_problems(ckpt) == [] and len(read) == 18  # without reuse: read again
    with open(ckpt / "common.pt", "ab") as f:  # changed since: grown, and read again
        f.write(b"x")
    assert checkpoint_problems(ckpt, reuse=True) == [f"common.pt: 701 bytes, {MANIFEST_FILE} says 700 (grown)"]
    assert len(read) == 26  # the 8 files of the right size


def test_resume_falls_back_past_damaged_checkpoints_and_says_why(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    assert find_resumable_checkpoint(root) is None  # nothing saved yet: start afresh
    _training_root(root, [1, 2, 3])
    assert find_resumable_checkpoint(root).iteration == 3
    _flip_byte(root / "iter_0000003" / "__0_1.distcp")
    (root / "iter_0000002" / "common.pt").unlink()
    capsys.readouterr()
    found = find_resumable_checkpoint(root)
    assert (found.path, found.iteration, found.verified) == (root / "iter_0000001", 1, True)
    assert len(found.skipped) == 2
    assert "iter_0000003 is damaged: __0_1.distcp: CRC-32" in found.skipped[0]
    assert "iter_0000002 is damaged: common.pt: missing" in found.skipped[1]
    err = capsys.readouterr().err
    assert "not resuming from" in err and "iter_0000003 is damaged: __0_1.distcp" in err
    assert f"resuming from the previous complete checkpoint {root / 'iter_0000001'}" in err


def test_resume_takes_an_unverifiable_legacy_checkpoint_and_refuses_when_none_is_intact(tmp_path):
    root = tmp_path / "checkpoints"
    _training_root(root, [1, 2], legacy=[1])
    with open(root / "iter_0000002" / "__1_1.distcp", "r+b") as f:
        f.truncate(0)
    found = find_resumable_checkpoint(root, report=False)
    assert (found.iteration, found.verified) == (1, False)
    _training_root(root2 := tmp_path / "all_bad", [1, 2])
    for i in (1, 2):
        (root2 / f"iter_{i:07d}" / "__0_0.distcp").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint there is intact.*iter_0000002 is damaged: "
        r"__0_0.distcp: missing.*iter_0000001 is damaged",
    ):
        find_resumable_checkpoint(root2)


def test_keep_checkpoints_keeps_the_newest_complete_ones(tmp_path):
    root = tmp_path / "checkpoints"
    _training_root(root, [1, 2, 3, 4, 5, 6])
    (root / ".incomplete_iter_0000009").mkdir()  # an interrupted save's staging
    assert prune_checkpoints(root, keep=0, newest=6) == []  # 0: keep all (stale staging still goes)
    assert not (root / ".incomplete_iter_0000009").exists()
    with open(root / "iter_0000005" / "__0_0.distcp", "r+b") as f:  # damaged: not one of the N kept
        f.truncate(5)
    deleted = prune_checkpoints(root, keep=2, newest=4)  # 5, 6: newer than the one just saved
    assert [p.name for p in deleted] == ["iter_0000002", "iter_0000001"]
    assert [i for i, _ in list_iterations(root)] == [3, 4, 5, 6]
    deleted = prune_checkpoints(root, keep=2, newest=6)  # 6 and 4 are the two newest complete
    assert [p.name for p in deleted] == ["iter_0000003"]
    assert [i for i, _ in list_iterations(root)] == [4, 5, 6]
    assert not [p for p in os.listdir(root) if p.startswith(".")]
