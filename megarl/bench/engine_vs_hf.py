"""megarl's torch engine against transformers' ``generate`` on one random model (scripts/gpu_smoke.sh,
second part): the same greedy prompts, tokens/s of each, and how many sequences came out identical.

The model is a random Llama of a preset's shape made by transformers itself (``from_config``, one
seed), saved as safetensors and loaded into the engine through the path a checkpoint takes
(``load_generator_params``): both sides hold the same weights. ``--batch`` prompts of random token
ids, exactly ``--max-new-tokens`` each (no end of sequence), so both do the same arithmetic;
transformers runs them as one left-padded batch. Random weights give near-uniform logits, so greedy
ties (and bf16 rounding) can part two correct implementations: the identical fraction is a reading,
the tests hold the engine to transformers (tests/unit/test_torch_engine.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from megarl.bench.timing import synchronize


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--preset", default=None, help="a Llama preset (default llama3-1b on a GPU, tiny on CPU)")
    p.add_argument("--batch", type=int, default=None, help="prompts (default 64 on a GPU, 4 on CPU)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 on a GPU, 16 on CPU")
    a = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from megarl.generator.interface import GenerationRequest, SamplingParams
    from megarl.generator.torch_engine.engine import TorchEngine
    from megarl.generator.weights import load_generator_params
    from megarl.models.hf_checkpoint import SafetensorsCheckpoint
    from megarl.models.presets import preset_config

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    preset, batch = a.preset or ("llama3-1b" if cuda else "tiny"), a.batch or (64 if cuda else 4)
    new = a.max_new_tokens or (128 if cuda else 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**preset_config(preset)), dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (batch, a.prompt), generator=g)
    result = {"preset": preset, "device": torch.cuda.get_device_name() if cuda else "cpu", "batch": batch}
    result.update(prompt_tokens=a.prompt, new_tokens=new)

    with torch.no_grad():
        ids = prompts.to(device)
        model.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        synchronize(device)
        hf_s = time.perf_counter() - start
    hf_tokens = out[:, a.prompt :].tolist()

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        hf = SafetensorsCheckpoint(tmp)
        params = load_generator_params(hf, 1, 0, dtype, device=device)
        engine = TorchEngine(
            hf.spec, params, max_running=batch, max_seq_len=a.prompt + new + 1, cpu_kernels="torch" if cuda else "auto"
        )
    del model
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new)
    engine.submit([GenerationRequest("warm", prompts[0].tolist(), SamplingParams(temperature=0.0, max_new_tokens=2))])
    engine.run_until_idle()
    synchronize(device)
    engine.submit([GenerationRequest(str(i), row, sampling) for i, row in enumerate(prompts.tolist())])
    start = time.perf_counter()
    done = engine.run_until_idle()
    synchronize(device)
    engine_s = time.perf_counter() - start
    engine_tokens = {c.request_id: c.output_ids for c in done}
    got = [engine_tokens[str(i)] for i in range(batch)]
    result.update(
        transformers_tokens_per_s=batch * new / hf_s,
        engine_tokens_per_s=sum(len(t) for t in got) / engine_s,
        identical_sequences=sum(x == y for x, y in zip(got, hf_tokens)),
        identical_tokens_before_first_difference=sum(
            next((i for i, (x, y) in enumerate(zip(e, h)) if x != y), min(len(e), len(h)))
            for e, h in zip(got, hf_tokens)
        ),
    )
    result["engine_over_transformers"] = result["engine_tokens_per_s"] / result["transformers_tokens_per_s"]
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
