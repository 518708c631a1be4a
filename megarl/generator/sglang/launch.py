"""Servers launched by the job: the checkpoint they start from, and starting one per replica.

Launch mode (``generator.backend: sglang`` with no ``generator.sglang_urls``):

1. the trainer ranks save their current weights (``publish_policy``: a
   Megatron dist checkpoint, every rank writing its own shard) and trainer
   rank 0 announces it in the job's store;
2. generator replica 0's first rank converts it to the Hugging Face
   directory SGLang loads (``serving_model``: streamed one layer at a time;
   block fp8 with ``weight_scale_inv`` when ``generator.fp8``, else
   ``generator.dtype``) -- generator ranks are idle at start, trainer ranks
   go on to their first sync;
3. every replica's first rank starts its server on its own node's GPUs
   (``start_replica_server``: base GPU id = its local rank, TP = generator.tp)
   and waits for ``/health``.

The first weight sync then overwrites what the servers loaded with the very
same weights over the shard-to-shard path, so a server that loaded an older
checkpoint would be corrected too; writing the checkpoint first keeps the
servers' start-up (shapes, fp8 post-processing) on the real policy.
"""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

from megarl.checkpointing.megatron_checkpoint import save_model
from megarl.errors import MegarlError
from megarl.generator.sglang import serving
from megarl.generator.sglang.server import SglangServer

POLICY_KEY = "megarl/sglang/policy_saved"
MODEL_KEY = "megarl/sglang/model_ready"


def publish_policy(chunks, spec, run_dir, store, tokenizer_files, first_rank: bool) -> None:
    """Trainer ranks (collective over the trainer's world): save the policy the servers start from."""
    root = serving.sglang_dir(run_dir) / "policy"
    if first_rank:
        shutil.rmtree(root, ignore_errors=True)
    save_model(chunks, root, spec, tokenizer_files=tokenizer_files)
    if first_rank:
        store.set(POLICY_KEY, str(root))


def serving_model(run_dir, store, replica: int, fp8: bool, dtype: str, timeout_s: float) -> Path:
    """The Hugging Face directory every launched server loads (replica 0 writes it)."""
    # Imported here: only this rank converts, and the trainer ranks and torch-engine generators import
    # this module too (generator/factory.py); megatron_to_hf's import would cost each 0.8-1.1 s
    # (measured 2026-12-03).
    from megarl.convert.megatron_to_hf import MegatronToHf, convert

    out = serving.sglang_dir(run_dir) / "model"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if replica == 0:
            store.wait([POLICY_KEY], timeout)
            shutil.rmtree(out, ignore_errors=True)
            convert(
                MegatronToHf(
                    megatron=store.get(POLICY_KEY).decode(), output=str(out), dtype=dtype, fp8=fp8, progress=False
                )
            )
            store.set(MODEL_KEY, str(out))
        else:
            store.wait([MODEL_KEY], timeout)
    except RuntimeError as e:  # the store's wait timed out, or the store is gone (rank 0 died)
        raise MegarlError(
            f"generator replica {replica}: the serving checkpoint {out} was not ready within {timeout_s:.0f} s ({e})"
        ) from None
    return out


def start_replica_server(g, replica: int, model_dir: Path, run_dir, base_gpu_id: int, routed_experts: bool = False):
    """Start replica ``replica``'s server (``g``: the generator config section); wait for health."""
    url = f"http://127.0.0.1:{g.sglang_port + replica}"
    server = SglangServer(
        serving.replica_command(g, replica, str(model_dir), base_gpu_id, routed_experts=routed_experts),
        serving.server_env(str(serving.sync_config_path(run_dir))),
        serving.sglang_dir(run_dir) / f"replica{replica}.log",
        url,
        f"SGLang server of generator replica {replica} ({url})",
    )
    server.wait_healthy(g.sglang_startup_timeout_s)
    return server
