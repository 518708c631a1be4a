"""The one-GPU check (scripts/gpu_check.sh): trainer and generator as separate processes on one
device, a weight sync in the middle of generation, and the figures that matter.

Needs only PyTorch and megatron-core (no transformers, no tokenizer, no
SGLang): a randomly initialised Llama of a preset shape (default ``llama3-1b``
-like, ~1.2B parameters), random prompt tokens, rewards of +-1.

    trainer process     Megatron GPTModel (local spec, bf16), DDP + distributed
                        Adam, AIPO RL steps on the generator's rollouts' shape;
                        after step 1 it pushes its weights shard to shard
    generator process   megarl's torch engine (SGLang layout), continuous
                        batching; between two decode steps it takes the new
                        weights (version 1) while its sequences are in flight

Both meet through a gloo sync group; on one GPU their bytes go through CUDA
IPC (weight_sync/ipc.py: NCCL refuses two ranks on one device). Prints one
JSON line: trainer tokens/s and MFU, generator tokens/s, sync seconds and
GB/s, and whether sequences carry two policy versions (version spans).
Runs on CPU too (``--device cpu --preset tiny``), which is how CI checks it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _preset(name: str):
    from megarl.models.presets import preset_config
    from megarl.models.spec import LlamaSpec

    if name == "llama3-1b":  # Llama 3.2 1B's shape, untied head so the sync moves both ends
        cfg = dict(preset_config("llama3-8b"), hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8)
    else:
        cfg = preset_config(name)
    return LlamaSpec.from_hf_config(cfg, source=f"preset {name}")


def _random_samples(spec, n: int, prompt_len: int, response_len: int, seed: int):
    from megarl.rollout import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = torch.randint(0, spec.vocab_size, (prompt_len,), generator=g).tolist()
        response = torch.randint(0, spec.vocab_size, (response_len,), generator=g).tolist()
        samples.append(Sample(prompt, response, [-10.0] * response_len, [0] * response_len,
                              reward=float(i % 2) * 2 - 1, group_id=i // 4))
    return samples


def _trainer(args, port: int, flag_port: int, out: str) -> None:
    import torch.distributed as dist

    from megarl.models.megatron_llama import build_model_chunks, transformer_config
    from megarl.runtime.distributed import ParallelLayout, init_distributed, init_megatron, shutdown
    from megarl.trainer.hooks import LossConfig
    from megarl.trainer.policy_trainer import PolicyTrainer
    from megarl.trainer.setup import OptimizerSettings, build_optimizer, unwrap, wrap_ddp
    from megarl.weight_sync import ipc
    from megarl.weight_sync.endpoints import TrainerSync
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology
    from megarl.weight_sync.rendezvous import init_sync_group

    init_distributed()
    spec = _preset(args.preset)
    init_megatron(ParallelLayout(1, 1))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    chunks = build_model_chunks(spec, transformer_config(spec, 1, 1, params_dtype=dtype, perform_initialization=True))
    ddp = wrap_ddp(chunks)
    trainer = PolicyTrainer(ddp, build_optimizer(ddp, OptimizerSettings(lr=1e-6)), spec.vocab_size,
                            LossConfig(), args.prompt_len + args.response_len)
    sync_group = init_sync_group("127.0.0.1", port, 2, 0, backend="gloo")
    flags = dist.TCPStore("127.0.0.1", flag_port, 2, is_master=True, wait_for_workers=False)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else None
    peers = ipc.colocated_peers(sync_group, 0, device)
    sync = TrainerSync(spec, TrainerTopology(1, 1, 1), GeneratorTopology(1, 1, first_rank=1), unwrap(ddp),
                       sync_group, 0, fp8=False, ipc_peers=peers)
    samples = _random_samples(spec, args.train_samples, args.prompt_len, args.response_len, seed=0)
    sync.push(0)  # the generator starts from the trainer's weights
    step_s = []
    for step in range(args.train_steps):
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.step(samples)
        if args.device == "cuda":
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
        if step == 0:  # mid-generation: the generator polls for this flag between decode steps
            flags.set("version", "1")
            stats = sync.push(1)
    tokens = args.train_samples * (args.prompt_len + args.response_len - 1)
    timed = step_s[1:] or step_s  # the first step includes warm-up
    tok_s = tokens / (sum(timed) / len(timed))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    result = {"device": name, "parameters_B": round(spec.num_parameters() / 1e9, 3),
              "trainer_tokens_per_s": tok_s, "trainer_step_seconds": step_s,
              "trainer_mfu": 6 * spec.num_parameters() * tok_s / peak if peak else None,
              "sync_GB": stats.bytes_sent / 1e9, "ipc": bool(peers)}
    Path(out, "trainer.json").write_text(json.dumps(result))
    shutdown()


def _generator(args, port: int, flag_port: int, out: str) -> None:
    import torch.distributed as dist

    from megarl.generator.interface import GenerationRequest, SamplingParams
    from megarl.generator.torch_engine.engine import TorchEngine
    from megarl.runtime.distributed import init_distributed, shutdown
    from megarl.weight_sync import ipc
    from megarl.weight_sync.endpoints import GeneratorSync, allocate_generator_params
    from megarl.weight_sync.planner import GeneratorTopology, TrainerTopology
    from megarl.weight_sync.rendezvous import init_sync_group

    init_distributed()
    spec = _preset(args.preset)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    params = allocate_generator_params(spec, 1, 0, dtype, device=device)
    sync_group = init_sync_group("127.0.0.1", port, 2, 1, backend="gloo")
    flags = dist.TCPStore("127.0.0.1", flag_port, 2, is_master=False)
    peers = ipc.colocated_peers(sync_group, 1, device if args.device == "cuda" else None)
    sync = GeneratorSync(spec, TrainerTopology(1, 1, 1), GeneratorTopology(1, 1, first_rank=1), 0, 0, params,
                         sync_group, ipc_peers=peers)
    sync.pull(expected_version=0)
    engine = TorchEngine(spec, params, max_running=args.batch, max_seq_len=args.prompt_len + args.max_new_tokens + 1)
    g = torch.Generator().manual_seed(1)
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=5)
    engine.submit([GenerationRequest(str(i), torch.randint(0, spec.vocab_size, (args.prompt_len,), generator=g).tolist(),
                                     sp, group_id=i) for i in range(args.prompts)])
    done, pull_s, update_at, start = [], None, None, time.perf_counter()
    while engine.stats()["queue_depth"] or engine.stats()["running"]:
        done += engine.step()
        if pull_s is None and flags.check(["version"]):  # between two decode steps
            t0 = time.perf_counter()
            engine.update_weights(lambda: sync.pull(expected_version=1), 1)
            pull_s = time.perf_counter() - t0
            update_at = t0 - start
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if pull_s is None:  # generation ended before the trainer's first step: still take the update
        flags.wait(["version"])
        t0 = time.perf_counter()
        engine.update_weights(lambda: sync.pull(expected_version=1), 1)
        pull_s = time.perf_counter() - t0
    tokens = sum(len(c.output_ids) for c in done)
    mixed = [c for c in done if len(c.version_spans()) > 1]
    Path(out, "generator.json").write_text(json.dumps({
        "generator_tokens_per_s": tokens / elapsed, "generated_tokens": tokens, "generate_seconds": elapsed,
        "sync_pull_seconds": pull_s, "update_at_seconds": update_at, "sequences": len(done), "sequences_with_two_versions": len(mixed),
        "version_spans_example": mixed[0].version_spans() if mixed else None}))
    shutdown()


def main(argv=None) -> dict:
    from megarl.runtime.distributed import free_port
    from megarl.runtime.launch import run_worlds

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=768, help="trainer rollout shape")
    p.add_argument("--train-samples", type=int, default=16)
    p.add_argument("--train-steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--batch", type=int, default=128, help="generator sequences in flight")
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    port, flag_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="megarl_gpu_check_") as out:
        run_worlds([(_trainer, 1, (args, port, flag_port, out)), (_generator, 1, (args, port, flag_port, out))])
        result = {**json.loads(Path(out, "trainer.json").read_text()),
                  **json.loads(Path(out, "generator.json").read_text())}
    # the pull is the transfer as the generator sees it (the push also waits for a decode step to end)
    result["sync_seconds"] = result["sync_pull_seconds"]
    result["sync_GB_per_s"] = result["sync_GB"] / result["sync_pull_seconds"]
    result["version_spans_appear"] = result["sequences_with_two_versions"] > 0
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
