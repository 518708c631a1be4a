"""One TP worker of tests/sglang_test_server.py: what an SGLang scheduler/TP worker process holds and does.

Each worker holds only its own TP shard of the served model, by SGLang's
parameter names and in SGLang's TP layout (tests/sglang_reference.py, written
from SGLang's loaders), and decodes with megarl's torch engine at that TP rank:
the workers of one server run the same schedule on the same requests, with
their all-reduces over their own gloo group, as SGLang's TP workers do over
NCCL. A weight update reaches a worker as SGLang's does
(scheduler_components/weight_updater.py + tp_worker.py): the worker
deserialises ``serialized_named_tensors[tp_rank]`` -- its own entry only --
under SGLang's SafeUnpickler allow-list and calls the custom loader named by
``load_format`` as ``loader(model, named_tensors)``, with
``model.named_parameters()`` giving that worker's shard; SGLang's
``get_tensor_model_parallel_rank()`` answers the worker's rank.

With TP 1 the server runs its one worker in its own process; with TP > 1 each
worker is a process of its own (``serve``), driven over a pipe.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import os
import pickle
import sys
import types
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch


def load_served_params(
    model_dir: Path, tp: int = 1, rank: int = 0, ep: int = 1
) -> Tuple[dict, Dict[str, torch.Tensor], bool]:
    """(HF config, SGLang parameters of TP rank ``rank`` of ``tp``, fp8) from a Hugging Face directory
    (fp8 weights dequantised and re-quantised per SGLang parameter, as SGLang's block-fp8 loader ends
    up holding them)."""
    from safetensors.torch import load_file

    from tests.sglang_reference import block_fp8, sglang_shard

    config = json.loads((model_dir / "config.json").read_text())
    full: Dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        full.update(load_file(str(path)))
    for name in [n for n in full if n.endswith("_scale_inv")]:
        scale = full.pop(name)
        w = full[name[: -len("_scale_inv")]]
        expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        full[name[: -len("_scale_inv")]] = w.float() * expanded
    fp8 = "quantization_config" in config
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[
        config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    ]
    if fp8:
        dtype = torch.bfloat16
    params = {}
    for name, t in sglang_shard(full, config, tp=tp, rank=rank, ep=ep).items():
        if fp8 and name.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")):
            params[name], params[name + "_scale_inv"] = block_fp8(t)
        else:
            params[name] = t.to(dtype).contiguous()
    return config, params, fp8


class ServedModel(torch.nn.Module):
    """What a custom weight loader receives: parameters by SGLang's names, sharing the engine's storage."""

    def __init__(self, params: Dict[str, torch.Tensor]):
        super().__init__()
        self._served = params

    def named_parameters(self, *args, **kwargs):
        for name, t in self._served.items():
            yield name, torch.nn.Parameter(t, requires_grad=False)


def present_tp_rank(rank: int) -> None:
    """What SGLang's TP worker offers a custom loader: ``sglang.srt.distributed``'s TP rank."""
    sys.modules["sglang.srt.distributed"] = types.SimpleNamespace(get_tensor_model_parallel_rank=lambda: rank)


class TPWorker:
    def __init__(
        self,
        model_dir: str,
        tp: int,
        rank: int,
        group,
        version: int,
        max_running: int,
        allowed_globals: set,
        ep: int = 1,
    ):
        from megarl.generator.torch_engine.engine import TorchEngine
        from megarl.models.spec import ModelSpec

        config, self.params, self.fp8 = load_served_params(Path(model_dir), tp, rank, ep)
        spec = ModelSpec.from_hf_config(config, source="sglang_test_server")
        self.rank = rank
        self.model = ServedModel(self.params)
        self.allowed = allowed_globals
        self.loads = 0
        self.engine = TorchEngine(
            spec,
            self.params,
            max_running=max_running,
            max_seq_len=1024,
            tp=tp,
            tp_rank=rank,
            group=group,
            version=version,
            ep=ep,  # --ep-size: experts over ep of the TP ranks (SGLang's FusedMoE layout)
        )

    def tick(self, submits: Sequence, aborts: Sequence[str]) -> Tuple[List, bool]:
        """Take the new requests and aborts, run one engine step: (finished completions, busy after)."""
        if submits:
            self.engine.submit(list(submits))
        if aborts:
            self.engine.abort(list(aborts))
        done = self.engine.step() if (self.engine.waiting or self.engine.running or self.engine.aborted) else []
        return done, bool(self.engine.waiting or self.engine.running or self.engine.aborted)

    def load(self, load_format: str, serialized: str, version: int) -> int:
        """SGLang's update_weights_from_tensor in this worker: its own payload, the custom loader."""
        allowed = self.allowed

        class SafeUnpickler(pickle.Unpickler):  # SGLang's find_class rule, with its own allow-list
            def find_class(self, module, name):
                if (module, name) not in allowed:
                    raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
                return super().find_class(module, name)

        named = SafeUnpickler(io.BytesIO(base64.b64decode(serialized, validate=True))).load()
        named = [(name, tensor.to("cpu")) for name, tensor in named]
        module, _, fn = load_format.rpartition(".")
        loader = getattr(importlib.import_module(module), fn)
        self.engine.update_weights(lambda: (loader(self.model, named), types.SimpleNamespace(version=version))[1])
        self.loads += 1
        return self.loads

    def set_version(self, version: int) -> None:
        self.engine.version = version

    def dump(self, out_dir: str) -> str:
        """This worker's parameters as they are now (tests compare them with the trainer's shard)."""
        from safetensors.torch import save_file

        path = os.path.join(out_dir, f"tp_rank{self.rank}.safetensors")
        save_file({n: t.contiguous() for n, t in self.params.items()}, path)
        return path


def serve(
    conn, model_dir: str, tp: int, rank: int, port: int, version: int, max_running: int, allowed, ep: int = 1
) -> None:
    """A worker process: join the workers' TP world (its default process group, as in an SGLang TP
    worker), load its shard, then run the front's calls until the front goes away."""
    import torch.distributed as dist

    if sys.platform.startswith("linux"):  # a SIGKILLed server takes its workers with it, as SGLang's do
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    try:
        torch.set_num_threads(1)
        present_tp_rank(rank)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
        worker = TPWorker(model_dir, tp, rank, dist.group.WORLD, version, max_running, allowed, ep)
    except Exception as e:
        conn.send(("error", f"start-up failed: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the front exited
            return
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception as e:  # reported by the front, naming this rank
            conn.send(("error", f"{type(e).__name__}: {e}"))
