"""vLLM's CPU build on the bench's workload, run by vLLM's own interpreter (not megarl's venv).

    /path/to/vllm-venv/bin/python megarl/bench/vllm_cpu_runner.py JOB.json

JOB.json: {"model_dir", "prompts" (token ids), "max_new_tokens", "batch", "dtype"}. Greedy,
exactly max_new_tokens per prompt (end of sequence ignored, as the bench's equal_work),
at most ``batch`` sequences in flight. One warm-up generate (model load, kernels, any
compilation) is not timed. Prints one JSON line: tokens, seconds, tokens_per_s. Imports
nothing from megarl: this file runs in an environment where megarl is not installed.
"""

import json
import os
import sys
import time


def main(job_path: str) -> None:
    job = json.load(open(job_path))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gb", 2)))
    # vLLM's CPU default reserves one core for its frontend and binds the worker to the rest:
    # on a 2-core machine that halves its compute; give it every core, as the engine gets.
    cores = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}" if cores > 1 else "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # vLLM after its environment is set, and only in vLLM's own interpreter: megarl's venv has no vLLM
    import vllm
    from vllm import LLM, SamplingParams

    prompts = job["prompts"]
    max_len = max(len(p) for p in prompts) + job["max_new_tokens"] + 8
    start = time.perf_counter()
    llm = LLM(
        model=job["model_dir"],
        dtype={"bf16": "bfloat16", "fp32": "float32"}[job["dtype"]],
        max_num_seqs=job["batch"],
        max_model_len=max_len,
        skip_tokenizer_init=True,
        seed=0,
        enforce_eager=bool(job.get("enforce_eager", False)),
        # the directory materialised from the GGUF has architectures: null; vLLM would resolve LlamaModel
        hf_overrides={"architectures": ["LlamaForCausalLM"]},
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=True, detokenize=False)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[: job["batch"]]], warm, use_tqdm=False)
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        json.dumps(
            {
                "vllm": vllm.__version__,
                "dtype": job["dtype"],
                "prompts": len(prompts),
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "setup_s": setup_s,
                "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outs[:2]],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1])
