"""megarl's SGLang backend against tests/sglang_test_server.py, route by route, without a training job.

- the lag bound: groups in flight when weights are updated are not aborted
  (the generator executor aborts nothing for its age); they finish on the
  server under the new version and are handed over oldest first; and
  ``backend.abort`` stops a request on the server by each of its samples' rids,
  which come back aborted;
- the pause mode megarl sends is one SGLang's PauseGenerationReqInput accepts
  (the server checks the Literal), and a mode it does not accept is refused;
- TP 2: the server's two worker processes each receive, through megarl's
  ``worker_receiver.pull_shards``, exactly their own shard of the trainer's
  Megatron TP-2 weights (compared with the HF tensors sliced SGLang's way,
  tests/sglang_reference.py), and decode together what transformers decodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.config import RolloutConfig
from megarl.data.datasets import PromptRecord, TokenizedPrompt
from megarl.executors.generator import GeneratorExecutor
from megarl.generator.interface import ABORTED, GenerationRequest, SamplingParams
from megarl.generator.sglang import serving
from megarl.generator.sglang.http_backend import SglangBackend, SglangServerError, get_ok, post
from tests.conftest import _env, make_tiny_llama, run_tool, server_port, start_world, transformers_greedy
from tests.sglang_reference import sglang_shard
from tests.unit.test_sglang_protocol import pause_modes_megarl_sends

SERVER = Path(__file__).resolve().parents[1] / "sglang_test_server.py"


class SglangTestServer:
    def __init__(self, model_dir: Path, tmp: Path, *flags: str, env=None):
        self.port = server_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"server{self.port}.log", "wb")
        cmd = [sys.executable, str(SERVER), "--model-path", str(model_dir), "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(
            cmd, env=dict(_env(), **(env or {})), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 300
        while not get_ok(self.url, "/health", timeout_s=2):
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
            assert time.monotonic() < deadline, "the test server did not come up"
            time.sleep(0.3)

    def stats(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url + "/test_stats", timeout=30) as r:
            return json.loads(r.read())

    def get(self, path: str) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url + path, timeout=120) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    return make_tiny_llama(tmp_path / "hf")


def _executor(backend, max_lag: int, max_new_tokens: int, policy: str = "wait"):
    prompts = [TokenizedPrompt([1, 2, 3, 4], PromptRecord([{"role": "user", "content": "q"}], "a"))]
    rollout = RolloutConfig(
        prompts_per_step=1,
        samples_per_prompt=2,
        max_new_tokens=max_new_tokens,
        max_lag=max_lag,
        max_lag_policy=policy,
    )
    # no stop token: every sample runs max_new_tokens decode steps, so the timing below is fixed
    return GeneratorExecutor(
        rollout, 4, seed=1, backend=backend, prompts=prompts, stop_ids=(), replica=0, groups_per_step=1
    )


def test_groups_in_flight_finish_under_updates_and_abort_stops_requests_by_rid(tiny_model, tmp_path):
    # two samples at a time at 40 ms a step: samples finish in waves ~2.5 s apart, so when the first
    # of three groups is complete (by the second wave), groups submitted with it are still on the
    # server (running or queued); which samples ran first depends on the order the backend's threads'
    # requests arrived in
    server = SglangTestServer(
        tiny_model, tmp_path, "--max-running-requests", "2", env={"SGLANG_TEST_STEP_DELAY_S": "0.04"}
    )
    backend = SglangBackend(server.url, health_interval_s=1.0)
    try:
        # max_lag_policy keep: two updates and batch 3 next take the groups in flight past max_lag 2,
        # which the loop's schedule never does (one update per batch); keep hands them over all the same
        ex = _executor(backend, max_lag=2, max_new_tokens=64, policy="keep")
        out = ex.generate(train_version=0, n_groups=1, drain=False)
        (first,) = [g[0].group_id for g in out.groups]
        in_flight = sorted(ex.pending)  # submitted at version 0 with the first, not finished
        assert in_flight and first not in in_flight, (first, in_flight)
        left = set(in_flight) | {g[0].group_id for g in ex.ready}  # one may have finished with the first
        for version in (1, 2):  # two updates while its samples run or wait on the server
            backend.update_weights(lambda v=version: SimpleNamespace(version=v))
        out = ex.generate(train_version=3, n_groups=1, drain=False)
        stats = server.stats()
        assert stats["aborted_rids"] == [] and stats["aborted"] == 0  # nothing aborted for its age
        (group,) = out.groups
        assert group[0].group_id in left
        ex.finish_in_flight()
        samples = [c for g in [group, *ex.ready] for c in g]
        assert {c.group_id for c in samples} == left  # every group in flight finished ...
        assert all(c.finish_reason == "length" and len(c.output_ids) == 64 for c in samples)
        # ... under the updates: SGLang's scheduler reports update_weight_version's version, and the spans
        # of weight_versions put the tokens sampled before them under versions 0 and 1. The third wave of
        # samples runs after the updates: some tokens are of version 2
        assert all(set(c.versions) <= {0, 1, 2} and c.versions == sorted(c.versions) for c in samples)
        assert any(2 in c.versions for c in samples)
        assert stats["pause_modes"] == {"in_place": 2} and stats["versions"] == ["1", "2"]

        # the backend's abort: each sample of a request on the server is stopped by its rid, once the
        # server holds both (the test server's /abort_request of a rid it has not received does nothing)
        calls = server.stats()["requests"]["/generate"]
        request = GenerationRequest("x", [1, 2, 3, 4], SamplingParams(max_new_tokens=64), n=2, group_id=-7)
        backend.submit([request])
        deadline = time.monotonic() + 30
        while server.stats()["requests"]["/generate"] < calls + 2:  # both received (64 tokens take ~2.6 s)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        backend.abort(["x"])
        back = []
        while len(back) < 2:
            back += backend.step()
        stats = server.stats()
        assert sorted(stats["aborted_rids"]) == ["x#0", "x#1"] and stats["aborted"] == 2
        assert all(c.finish_reason == ABORTED and len(c.output_ids) < 64 for c in back)
    finally:
        backend.close()
        server.close()


def test_pause_modes_are_checked_against_sglangs_literal(tiny_model, tmp_path):
    server = SglangTestServer(tiny_model, tmp_path)
    try:
        for mode in pause_modes_megarl_sends():  # what megarl sends is accepted and exercised
            post(server.url, "/pause_generation", {"mode": mode}, 30)
            post(server.url, "/continue_generation", {}, 30)
        for bad, named in (("inplace", "not one of SGLang's values"), (1, "not one of SGLang's values")):
            with pytest.raises(SglangServerError, match=f"HTTP 400.*{named}"):
                post(server.url, "/pause_generation", {"mode": bad}, 30)
        with pytest.raises(SglangServerError, match="HTTP 404"):  # a route SGLang does not serve
            post(server.url, "/pause_generations", {"mode": "in_place"}, 30)
        with pytest.raises(SglangServerError, match=r"HTTP 400.*required fields \['new_version'\]"):
            post(server.url, "/update_weight_version", {"abort_all_requests": False}, 30)
        assert server.stats()["pause_modes"] == {m: 1 for m in pause_modes_megarl_sends()}
    finally:
        server.close()


def _safetensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def _hf_tensors(model_dir: Path):
    return _safetensors(model_dir / "model.safetensors"), json.loads((model_dir / "config.json").read_text())


@pytest.mark.slow
def test_tp2_workers_each_pull_their_own_shard_of_the_trainers_weights(tmp_path):
    from megarl.checkpointing.megatron_checkpoint import read_spec, resolve_checkpoint_dir
    from megarl.parallel_dims import GeneratorDims, ParallelDims
    from megarl.weight_sync.settings import SyncGeometry, SyncRendezvous, SyncSettings, WireFormat
    from megarl.weight_sync.synchronizer import SglangShardReceiver

    served = make_tiny_llama(tmp_path / "served", seed=1)  # what the server loads at start
    trained = make_tiny_llama(tmp_path / "trained", seed=0)  # the trainer's weights
    megatron = tmp_path / "megatron"
    run_tool("convert_hf_to_megatron.py", "--hf-model", trained, "--output", megatron, "--tp", 1, "--pp", 1)
    spec = read_spec(resolve_checkpoint_dir(megatron))
    settings = SyncSettings(
        SyncGeometry(spec, ParallelDims(tp=2), GeneratorDims(tp=2)),
        # the tiny model is float32: every element must arrive exactly
        WireFormat(fp8=False, dtype=torch.float32, verify=True),
    )
    rendezvous = SyncRendezvous("127.0.0.1", server_port(), "gloo", 300.0, serving.SYNC_GROUP_NAME)
    sync_config = serving.write_sync_config(tmp_path / "sync_config.json", settings, rendezvous)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    server = SglangTestServer(
        served,
        tmp_path,
        "--tp-size",
        "2",
        "--weight-version",
        "0",
        "--custom-weight-loader",
        serving.WORKER_LOADER,
        env={serving.SYNC_CONFIG_ENV: sync_config, "SGLANG_TEST_DUMP_DIR": str(dumps)},
    )
    backend = SglangBackend(server.url, health_interval_s=1.0)
    trainer = None
    try:
        stats = server.stats()
        assert (
            stats["tp_size"] == 2
            and len(set(stats["worker_pids"])) == 2
            and server.proc.pid not in stats["worker_pids"]
        )
        served_full, config = _hf_tensors(served)
        trained_full, _ = _hf_tensors(trained)
        before = server.get("/test_dump_params")["files"]
        for rank, path in enumerate(before):  # each worker loaded its own SGLang shard at start
            got, want = _safetensors(path), sglang_shard(served_full, config, 2, rank)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[n], want[n]) for n in want), rank

        trainer = start_world(2, "sglang_trainer.py", "--model", megatron, "--sync-config", sync_config, "--version", 1)
        # the driver's side of a sync (what SglangShardReceiver does in `megarl train`)
        landed = SglangShardReceiver(backend, 2, serving.WORKER_LOADER).sync(1)
        assert trainer.wait(300) == 0, "".join(trainer.output())[-4000:]
        assert landed.version == 1 and backend.version == 1
        stats = server.stats()
        assert stats["worker_loads"] == [1, 1] and stats["updates"] == 1
        for route in ("/pause_generation", "/begin_weight_update", "/update_weights_from_tensor"):
            assert stats["requests"][route] == 1, (route, stats)

        after = server.get("/test_dump_params")["files"]
        for rank, path in enumerate(after):
            got = _safetensors(path)
            want = sglang_shard(trained_full, config, 2, rank)  # the trainer's weights, TP rank r's slice
            other = sglang_shard(trained_full, config, 2, 1 - rank)
            assert got.keys() == want.keys()
            wrong = [n for n in want if not torch.equal(got[n], want[n])]
            assert not wrong, (rank, wrong)
            # its own shard, not the other rank's (the norms are the same on both)
            assert not torch.equal(
                got["model.layers.0.self_attn.qkv_proj.weight"], other["model.layers.0.self_attn.qkv_proj.weight"]
            )

        # the two workers decode together what transformers decodes from the trainer's weights
        prompts, stops = [[5, 17, 42, 8], [99, 3]], (2,)  # 2: the tiny config's eos, where transformers stops
        params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=stops)
        backend.submit([GenerationRequest(f"p{i}", ids, params) for i, ids in enumerate(prompts)])
        done = []
        deadline = time.monotonic() + 120
        while len(done) < len(prompts) and time.monotonic() < deadline:
            done += backend.step(0.2)
        by_id = {c.request_id: c for c in done}
        for i, (tokens, logprobs) in enumerate(transformers_greedy(trained, prompts, 8, stops)):
            c = by_id[f"p{i}"]
            assert c.output_ids == tokens and c.versions == [1] * len(tokens), (c.output_ids, tokens)
            assert (torch.tensor(c.logprobs) - logprobs).abs().max().item() <= 1e-4, (c.logprobs, logprobs)
    finally:
        if trainer is not None:
            trainer.close()
        backend.close()
        server.close()
