"""Rank body for the tensor-parallel engine test: every rank runs the same schedule.

torchrun --nproc-per-node 3 tests/workers/engine_worker.py --hf DIR --prompts FILE --out FILE
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl.generator.interface import GenerationRequest, SamplingParams  # noqa: E402
from megarl.generator.torch_engine.engine import TorchEngine  # noqa: E402
from megarl.generator.weights import load_generator_params  # noqa: E402
from megarl.models.hf_checkpoint import SafetensorsCheckpoint  # noqa: E402
from megarl.runtime.distributed import init_distributed, shutdown  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--ep", type=int, default=1)  # SGLang's --ep-size, inside the TP group
    args = p.parse_args()
    rank = init_distributed()
    tp = dist.get_world_size()
    hf = SafetensorsCheckpoint(args.hf)
    spec = json.load(open(args.prompts))
    engine = TorchEngine(
        hf.spec,
        load_generator_params(hf, tp, rank, torch.float32, ep=args.ep),
        max_running=4,
        max_seq_len=384,
        tp=tp,
        tp_rank=rank,
        group=dist.group.WORLD,
        ep=args.ep,
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(spec["stops"]))
    engine.submit([GenerationRequest(str(i), ids, params) for i, ids in enumerate(spec["prompts"])])
    done = engine.run_until_idle()
    if rank == 0:
        out = {}
        for c in done:
            routes = None if c.routed_experts is None else c.routed_experts.tolist()
            out[c.request_id] = {"tokens": c.output_ids, "logprobs": c.logprobs, "routes": routes}
        json.dump(out, open(args.out, "w"))
    shutdown()


if __name__ == "__main__":
    main()
