"""The SGLang GPU check (scripts/gpu_check_sglang.sh): an SGLang server serving block fp8, the
Megatron trainer with the Transformer Engine layer spec, and an in-flight shard-to-shard update.

For machines with SGLang and Transformer Engine installed (``pip install -e .[gpu]``):

1. writes a random ~1.2B Llama as a block-fp8 Hugging Face checkpoint (float8_e4m3fn weights
   with 128x128 ``weight_scale_inv``; ``quantization_config`` quant_method fp8) -- the format
   SGLang serves and megarl's senders quantise to;
2. starts ``sglang.launch_server`` on it (``--skip-tokenizer-init``: token ids in and out) with
   megarl's receiver as custom weight loader (serving.py) and weight version 0;
3. starts the trainer (Megatron GPTModel, TE spec when TE imports, bf16, random init) as a
   second process; both join a sync group (gloo; on one GPU the bytes go through CUDA IPC);
4. sends prompts through megarl's SglangBackend, and while they decode runs SGLang's in-flight
   update protocol (pause in place -> begin -> megarl's receiver in the TP worker <- the
   trainer's push -> end -> update_weight_version(abort_all_requests=false) -> continue);
5. prints one JSON line: generator tokens/s, sync seconds and GB/s, the trainer's step
   tokens/s, and whether finished requests carry two weight-version spans.

Untested on this project's CPU machines (SGLang needs a GPU); its request bodies and response
parsing are tested on CPU against SGLang's own types (tests/test_sglang_protocol.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch


def write_block_fp8_checkpoint(spec, out: Path, seed: int = 0) -> None:
    from safetensors.torch import save_file

    from megarl.generator.sglang.serving import block_fp8_hf_config
    from megarl.weight_sync import fp8
    from megarl.weight_sync.layouts import logical_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in logical_shapes(spec).items():
        if "norm" in name:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        w = torch.randn(shape, generator=g) * 0.02
        if "layers." in name:  # the linears: block fp8, as SGLang's Fp8LinearMethod loads them
            q, scale_inv = fp8.quantize(w)
            tensors[name] = q
            tensors[name.replace(".weight", ".weight_scale_inv")] = scale_inv
        else:
            tensors[name] = w.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(block_fp8_hf_config(dict(spec.hf_config, torch_dtype="bfloat16",
                                                                         architectures=["LlamaForCausalLM"]))))


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"sglang server at {url} not healthy after {timeout_s} s")


def _trainer(args, sync_config: str, out: str) -> None:
    from megarl.bench.gpu_check import _preset, _random_samples
    from megarl.models.megatron_llama import build_model_chunks, transformer_config, transformer_engine_usable
    from megarl.runtime.distributed import ParallelLayout, init_distributed, init_megatron, shutdown
    from megarl.trainer.hooks import LossConfig
    from megarl.trainer.policy_trainer import PolicyTrainer
    from megarl.trainer.setup import OptimizerSettings, build_optimizer, unwrap, wrap_ddp
    from megarl.weight_sync import ipc
    from megarl.weight_sync.endpoints import TrainerSync
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology
    from megarl.weight_sync.rendezvous import init_sync_group

    cfg = json.loads(Path(sync_config).read_text())
    init_distributed()
    spec = _preset(args.preset)
    init_megatron(ParallelLayout(1, 1))
    te = transformer_engine_usable()
    chunks = build_model_chunks(spec, transformer_config(spec, 1, 1, params_dtype=torch.bfloat16,
                                                          perform_initialization=True))
    ddp = wrap_ddp(chunks)
    trainer = PolicyTrainer(ddp, build_optimizer(ddp, OptimizerSettings(lr=1e-6)), spec.vocab_size, LossConfig(),
                            args.prompt_len + args.response_len)
    samples = _random_samples(spec, 16, args.prompt_len, args.response_len, seed=0)
    start = time.perf_counter()
    trainer.step(samples)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - start
    group = init_sync_group(cfg["host"], cfg["port"], 2, 0, backend=cfg["backend"])
    peers = ipc.colocated_peers(group, 0, torch.device("cuda", torch.cuda.current_device()))
    sync = TrainerSync(spec, TrainerTopology(1, 1, 1, norm_names="te" if te else "local"),
                       GeneratorTopology(1, 1, first_rank=1), unwrap(ddp), group, 0, fp8=True, ipc_peers=peers)
    stats = sync.push(1)
    Path(out, "trainer.json").write_text(json.dumps({
        "transformer_engine": te, "trainer_step_seconds": step_s,
        "trainer_tokens_per_s": len(samples) * (args.prompt_len + args.response_len - 1) / step_s,
        "sync_GB": stats.bytes_sent / 1e9, "sync_push_seconds": stats.seconds, "ipc": bool(peers)}))
    shutdown()


def main(argv=None) -> dict:
    from megarl.bench.gpu_check import _preset
    from megarl.generator.interface import GenerationRequest, SamplingParams
    from megarl.generator.sglang import serving
    from megarl.generator.sglang.http_backend import SglangBackend
    from megarl.runtime.distributed import free_port
    from megarl.runtime.launch import run_worlds
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=768)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--mem-fraction", type=float, default=0.4, help="SGLang's share: the trainer shares the GPU")
    args = p.parse_args(argv)
    spec = _preset(args.preset)
    port, sync_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    import threading

    with tempfile.TemporaryDirectory(prefix="megarl_sglang_check_") as tmp:
        model_dir = Path(tmp, "model")
        write_block_fp8_checkpoint(spec, model_dir)
        sync_config = serving.write_sync_config(str(Path(tmp, "sync.json")), spec, TrainerTopology(1, 1, 1),
                                                GeneratorTopology(1, 1, first_rank=1), "127.0.0.1", sync_port,
                                                fp8=True)
        cmd = [sys.executable, "-m", "sglang.launch_server", *serving.server_args(str(model_dir), port, 1, 0,
                                                                                     mem_fraction=args.mem_fraction),
               "--skip-tokenizer-init"]
        server = subprocess.Popen(cmd, env=serving.server_env(sync_config))
        try:
            _wait_healthy(url, server)
            backend = SglangBackend([url], tp=1)
            g = torch.Generator().manual_seed(1)
            sp = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=3)
            backend.submit([GenerationRequest(str(i), torch.randint(0, spec.vocab_size, (args.prompt_len,),
                                                                    generator=g).tolist(), sp, group_id=i)
                            for i in range(args.prompts)])
            # a process of its own (spawned), driven from a thread so this one keeps polling SGLang
            trainer = threading.Thread(target=run_worlds, args=([(_trainer, 1, (args, sync_config, tmp))],))
            start = time.perf_counter()
            trainer.start()
            done = []
            while len(done) < args.prompts // 8:  # some finish under version 0 first
                done += backend.step()
            t0 = time.perf_counter()
            backend.update_weights(backend.trigger_shard_to_shard(1), 1)  # the trainer pushes meanwhile
            update_s = time.perf_counter() - t0
            trainer.join()
            while len(done) < args.prompts:
                done += backend.step()
            elapsed = time.perf_counter() - start
            t = json.loads(Path(tmp, "trainer.json").read_text())
        finally:
            server.terminate()
            server.wait(timeout=60)
    tokens = sum(len(c.output_ids) for c in done)
    mixed = [c for c in done if len(c.version_spans()) > 1]
    result = {**t, "generator_tokens_per_s": tokens / elapsed, "generated_tokens": tokens,
              "update_protocol_seconds": update_s, "sync_GB_per_s": t["sync_GB"] / update_s,
              "sequences_with_two_versions": len(mixed), "version_spans_appear": bool(mixed),
              "version_spans_example": mixed[0].version_spans() if mixed else None}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main()
