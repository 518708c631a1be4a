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
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from megarl.checkpointing import manifest
from megarl.checkpointing.manifest import MANIFEST_FILE, checkpoint_problems, verify_checkpoint
from megarl.checkpointing.megatron_checkpoint import TRACKER_FILE, resolve_checkpoint_dir
from megarl.checkpointing.resume import find_resumable_checkpoint, list_iterations, prune_checkpoints
from megarl.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


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


# -- manifest: written and verified --------------------------------------------------------------


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


@pytest.mark.slow
def test_a_converted_release_checkpoint_has_a_manifest_of_all_four_ranks_files(tiny_megatron):
    ckpt = resolve_checkpoint_dir(tiny_megatron, verify="checksums")  # tools/convert_hf_to_megatron.py, TP2 x PP2
    assert ckpt.name == "release"
    files = json.loads((ckpt / MANIFEST_FILE).read_text())["files"]
    on_disk = {Path(d, f).relative_to(ckpt).as_posix() for d, _, names in os.walk(ckpt) for f in names}
    assert set(files) == on_disk - {MANIFEST_FILE}
    assert {n.split("_")[2] for n in files if n.endswith(".distcp")} == {"0", "1", "2", "3"}  # __<rank>_<n>
    for name, entry in files.items():
        data = (ckpt / name).read_bytes()
        assert entry["size"] == len(data) and entry["crc32"] == f"{zlib.crc32(data):08x}", name


# -- the fallback on resume ----------------------------------------------------------------------


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


def _verify_in_group(rank: int, world: int, ckpt: str, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    read = []
    real = manifest.file_crc32
    # which files this rank summed, as (checkpoint, file)
    manifest.file_crc32 = lambda p: read.append(Path(p).relative_to(ckpt).as_posix()) or real(p)
    found = find_resumable_checkpoint(Path(ckpt), group=dist.group.WORLD, report=False)
    Path(out, f"{rank}.json").write_text(
        json.dumps({"iteration": found.iteration, "skipped": found.skipped, "read": read})
    )
    dist.destroy_process_group()


def test_ranks_of_a_group_share_the_checksums_and_agree(tmp_path):
    root = tmp_path / "checkpoints"
    _training_root(root, [1, 2])
    _flip_byte(root / "iter_0000002" / "__1_0.distcp")
    world = 2
    mp.start_processes(
        _verify_in_group,
        args=(world, str(root), str(tmp_path / "init"), str(tmp_path)),
        nprocs=world,
        start_method="spawn",
    )
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    assert results[0]["skipped"] == results[1]["skipped"] and len(results[0]["skipped"]) == 1
    assert "__1_0.distcp: CRC-32" in results[0]["skipped"][0]
    assert [r["iteration"] for r in results] == [1, 1]
    # both checkpoints were checked in full (2 was damaged): each file by exactly one rank
    expected = sorted(
        f"iter_{i:07d}/{name}"
        for i in (1, 2)
        for name in json.loads((root / f"iter_{i:07d}" / MANIFEST_FILE).read_text())["files"]
    )
    assert sorted(results[0]["read"] + results[1]["read"]) == expected
    assert results[0]["read"] and results[1]["read"]


# -- run.keep_checkpoints -------------------------------------------------------------------------


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


# -- end to end ---------------------------------------------------------------------------------------


def _megarl(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "megarl.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _train(out: Path, steps: int):
    proc = _megarl(
        "train",
        "--config",
        TINY,
        f"run.output_dir={out}",
        "model.tokenizer=none",
        "data.train=random:64:1:12",
        "reward.function=synthetic_parity",
        "run.save_every=1",
        f"run.steps={steps}",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_truncated_latest_checkpoint_is_named_and_the_relaunch_resumes_from_the_previous(tmp_path):
    out = tmp_path / "run"
    root = out / "checkpoints"
    _train(out, steps=2)
    assert [i for i, _ in list_iterations(root)] == [1, 2]
    for it in (1, 2):
        assert verify_checkpoint(root / f"iter_{it:07d}") is True
        files = json.loads((root / f"iter_{it:07d}" / MANIFEST_FILE).read_text())["files"]
        assert {"metadata.json", ".metadata", "common.pt", "megarl_model.json"} <= set(files)
        assert sum(n.endswith(".distcp") for n in files) >= 2  # both trainer ranks' files
    victim = root / "iter_0000002" / "__1_0.distcp"
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    why = f"__1_0.distcp: {size // 2} bytes, {MANIFEST_FILE} says {size} (truncated)"

    # megarl eval and the converter refuse the broken checkpoint, naming the file, before loading
    for args in (
        ("eval", "--checkpoint", str(out), "--data", "arithmetic:4:1"),
        ("convert", "megatron-to-hf", "--megatron", str(root), "--output", str(tmp_path / "hf")),
    ):
        proc = _megarl(*args, timeout=300)
        assert proc.returncode == 2, (args, proc.stderr[-3000:])
        assert f"iter_0000002 is damaged: {why}" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert not (tmp_path / "hf").exists()

    before = len((out / "metrics.jsonl").read_text().splitlines())
    proc = _train(out, steps=4)
    assert f"not resuming from {root / 'iter_0000002'} is damaged: {why}" in proc.stderr, proc.stderr[-3000:]
    assert f"resuming from the previous complete checkpoint {root / 'iter_0000001'}" in proc.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[:before] == [1, 2] and steps[before:] == [2, 3, 4]  # step 2 trained again, from iteration 1
    assert [i for i, _ in list_iterations(root)] == [1, 2, 3, 4]
    for it in (1, 2, 3, 4):  # the damaged iteration 2 was replaced by a complete one
        assert verify_checkpoint(root / f"iter_{it:07d}") is True
    assert (root / TRACKER_FILE).read_text().strip() == "4"
