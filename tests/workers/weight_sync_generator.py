"""Generator side of the weight-sync tests: SGLang-layout receivers in their own torchrun
world (megarl's sync, or with --baseline baseline.py's broadcast receiver), checked against
tests/sglang_reference.py (the HF tensors sliced SGLang's way).

Takes the trainer worker's arguments plus --trainers N and --out DIR; TP rank r of
replica q is sync rank N + q * tp + r. Writes OUT/results_rank<r>.json.
"""

import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from weight_sync_cases import cases, trainer_sizes  # noqa: E402
from weight_sync_trainer import case_settings, pack_threshold, parse, stage_group, sync_group  # noqa: E402

from megarl.checkpointing.megatron_checkpoint import read_spec, resolve_checkpoint_dir  # noqa: E402
from megarl.parallel_dims import GeneratorDims, ParallelDims
from megarl.runtime.distributed import init_distributed, shutdown  # noqa: E402
from megarl.runtime.rendezvous import destroy_sync_group  # noqa: E402
from megarl.weight_sync import fp8 as fp8_format  # noqa: E402
from megarl.weight_sync.baseline import gather_broadcast_receive  # noqa: E402
from megarl.weight_sync.endpoints import GeneratorSync, allocate_generator_params  # noqa: E402
from megarl.weight_sync.transport import SyncStats, WeightReceiver  # noqa: E402
from tests.sglang_reference import SGLANG_FP8_WEIGHTS, block_fp8, sglang_shard  # noqa: E402


@functools.lru_cache(maxsize=None)  # read once per model, not once per case (SmolLM2: 0.5 GB per read)
def hf_tensors(model_dir):
    """The HF model the Megatron checkpoint was converted from (its sibling 'hf' directory); read-only."""
    hf = os.path.join(os.path.dirname(model_dir.rstrip("/")), "hf")
    full = {}
    for f in sorted(os.listdir(hf)):
        if f.endswith(".safetensors"):
            full.update(load_file(os.path.join(hf, f)))
    return full, json.load(open(os.path.join(hf, "config.json")))


def main():
    args = parse_with_trainers()
    rank = init_distributed()
    sync_rank = args.trainers + rank
    store, group = sync_group(args, sync_rank, args.trainers + args.generators)
    results = []
    version = 0
    for case in cases(args, args.trainers):
        spec = read_spec(resolve_checkpoint_dir(case.model))
        tp, pp, vpp, ep, etp = trainer_sizes(case.layout)
        trainer = ParallelDims(tp=tp, pp=pp, dp=args.trainers // (tp * pp), vpp=vpp, ep=ep, etp=etp)
        generator = GeneratorDims(tp=case.dst_tp, replicas=args.generators // case.dst_tp, ep=case.dst_ep)
        replica, tp_rank = divmod(rank, case.dst_tp)
        params = allocate_generator_params(spec, case.dst_tp, tp_rank, case.dtype, case.fp8, ep=case.dst_ep)
        version += 1
        settings = case_settings(args, spec, trainer, generator, case, version)
        if args.baseline:
            groups = [stage_group(store, version, s, args.generators, 1 + rank) for s in range(trainer.pp)]
            got = gather_broadcast_receive(settings, tp_rank, params, groups)
            for g in groups:
                destroy_sync_group(g)
            stats = SyncStats(version=version, bytes_received=got["received_bytes"])
        else:
            plan = settings.geometry.plan()
            ipc_peers = set(range(args.trainers)) if args.ipc else None
            if pack_threshold(args, version) is None:
                sync = GeneratorSync(settings, replica, tp_rank, params, group, plan=plan, ipc_peers=ipc_peers)
                stats = sync.pull(expected_version=version)
            else:
                sync_rank = settings.geometry.generator_rank(replica, tp_rank)
                receiver = WeightReceiver(plan, sync_rank, group, params, settings.wire, ipc_peers)
                stats = receiver.receive(expected_version=version)
        full, config = hf_tensors(case.model)
        reference = sglang_shard(full, config, case.dst_tp, tp_rank, case.dst_ep)
        record = {
            "case": case.name,
            "rank": rank,
            "version": stats.version,
            "bytes_received": stats.bytes_received,
            "rounds": stats.rounds,
            "wire_messages": stats.wire_messages,
            "messages": stats.messages,
            "pack_below": None if args.baseline else pack_threshold(args, version),
            "mismatches": [],
            "max_fp8_error": 0.0,
            "scale_mismatches": [],
        }
        # The shard's size: every element SGLang's loader writes (not the vocabulary padding).
        real = 0
        for name, ref in reference.items():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                start = tp_rank * ref.shape[0]
                real += max(0, min(config["vocab_size"], start + ref.shape[0]) - start) * ref.shape[1]
            else:
                real += ref.numel()
        record["expected_bytes"] = real * case.dtype.itemsize
        if case.fp8:  # every fp8 weight as e4m3 bytes plus its fp32 block scales, the rest as before
            fp8_names = [n for n in reference if n.endswith(SGLANG_FP8_WEIGHTS)]
            linear = sum(reference[n].numel() for n in fp8_names)
            # one fp32 scale per 128 x 128 block of each 2-D weight, of each expert of a stacked one
            scales = sum(
                reference[n][..., 0, 0].numel() * -(-reference[n].shape[-2] // 128) * -(-reference[n].shape[-1] // 128)
                for n in fp8_names
            )
            record["expected_fp8_bytes"] = (real - linear) * case.dtype.itemsize + linear + 4 * scales
        for name, ref in reference.items():
            got = params[name]
            if case.fp8 and name.endswith(SGLANG_FP8_WEIGHTS):
                want_q, want_scale = block_fp8(ref.to(case.dtype))
                scale = params[fp8_format.scale_name(name)]
                if not torch.equal(scale, want_scale):
                    record["scale_mismatches"].append(name)
                deq = fp8_format.dequantize(got, scale)
                # e4m3 keeps 3 mantissa bits: |error| <= half a unit in the last place, 2^-4 relative
                bound = (ref.to(case.dtype).float().abs() * 2**-4 + scale.max() * 2**-9).max()
                err = (deq - ref.to(case.dtype).float()).abs().max().item()
                record["max_fp8_error"] = max(record["max_fp8_error"], err / bound.item())
                if not torch.equal(got.view(torch.uint8), want_q.view(torch.uint8)):
                    record["mismatches"].append(name + " (fp8 bytes)")
                continue
            if got.dtype != case.dtype or not torch.equal(got, ref.to(case.dtype)):
                record["mismatches"].append(name)
        results.append(record)
    with open(os.path.join(args.out, f"results_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier(group=group)
    shutdown()


def parse_with_trainers():
    sys_argv = list(sys.argv)
    trainers = int(sys_argv[sys_argv.index("--trainers") + 1])
    i = sys_argv.index("--trainers")
    del sys_argv[i : i + 2]
    sys.argv = sys_argv
    args = parse()
    args.trainers = trainers
    return args


if __name__ == "__main__":
    main()
