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
from megarl.checkpointing.manifest import MANIFEST_FILE, verify_checkpoint
from megarl.checkpointing.megatron_checkpoint import TRACKER_FILE, resolve_checkpoint_dir
from megarl.checkpointing.resume import find_resumable_checkpoint, list_iterations
from tests.unit.test_checkpoint_integrity import _flip_byte, _training_root

ROOT = Path(__file__).resolve().parents[2]


TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


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
