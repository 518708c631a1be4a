"""The SGLang GPU check (scripts/gpu_check_sglang.sh): megarl/bench/gpu_check.py with
``--backend sglang`` -- `megarl train` launches an SGLang server for its generator replica
(block fp8, loaded from the checkpoint the job writes from the trainer's weights), the
Megatron trainer (Transformer Engine's layer spec when TE imports, bf16) shares the GPU,
and every weight update runs SGLang's in-flight protocol into megarl's receiver inside
the SGLang TP worker (CUDA IPC from the trainer on the same device).

Needs SGLang and Transformer Engine (``pip install -e .[gpu]``). On CPU its driver, the
job's side of the protocol and the receiver run against tests/sglang_test_server.py
(tests/multiprocess/test_sglang_loop.py).
"""

from __future__ import annotations

import os

from megarl.bench.gpu_check import main

if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main(backend="sglang")
