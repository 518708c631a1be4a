"""A protocol test server that speaks SGLang 0.5.23's HTTP routes, for megarl's CPU tests only.

SGLang cannot run without a GPU, so the end-to-end tests start this script
exactly where megarl starts ``python -m sglang.launch_server`` (launch mode:
``generator.sglang_launcher``) or point ``generator.sglang_urls`` at it
(attach mode). It holds to SGLang's side of the contract, read from SGLang's
own installed source (tests/sglang_source.py):

- every command-line flag must be a ServerArgs field;
- every request body must use only the fields of SGLang's request type for
  that route (GenerateReqInput + SamplingParams, PauseGenerationReqInput,
  AbortReq, UpdateWeightsFromTensorReqInput, ...); anything else is a 400;
- ``/update_weights_from_tensor`` payloads are deserialised with SGLang's
  SafeUnpickler allow-list and handed to the custom weight loader named by
  ``load_format`` (which must have been given with --custom-weight-loader),
  called as SGLang calls it in each TP worker: ``loader(model, named_tensors)``
  with ``model.named_parameters()`` in SGLang's names -- i.e. megarl's
  ``worker_receiver.pull_shards``, which joins the trainer's sync group;
- in-place pause keeps requests and their KV cache; updates happen only
  inside begin/end_weight_update; per-token versions are reported with
  SGLang's own span code (``weight_versions`` spans, ``weight_version``).

It decodes with megarl's torch engine (TP 1) over the SGLang-layout tensors,
loaded from --model-path by tests/sglang_reference.py (written from SGLang's
loaders, independently of megarl's layouts). GET /test_stats reports what it
served (not an SGLang route: only the tests read it), also written after every
request to the file named by SGLANG_TEST_STATS when set. The environment
variable SGLANG_TEST_STEP_DELAY_S adds that many seconds to every decode step:
a GPU generator is slower than a tiny model's trainer, which is what makes
weight updates land in the middle of sequences.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import os
import pickle
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import sglang_source  # noqa: E402
import torch  # noqa: E402

ROUTE_TYPES = {
    "/generate": "GenerateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/abort_request": "AbortReq",
}
BOOLEAN_FLAGS = {"skip_server_warmup", "skip_tokenizer_init"}


def parse_args(argv: List[str]) -> Dict[str, List[str]]:
    fields = sglang_source.server_arg_fields()
    args: Dict[str, List[str]] = {}
    key = None
    for token in argv:
        if token.startswith("--"):
            key = token[2:].replace("-", "_")
            if key not in fields:
                sys.exit(f"sglang_test_server: --{token[2:]} is not an SGLang ServerArgs field")
            args[key] = []
            if key in BOOLEAN_FLAGS:
                key = None
        elif key is None:
            sys.exit(f"sglang_test_server: unexpected argument {token!r}")
        else:
            args[key].append(token)
    return args


# -- the model ------------------------------------------------------------------------------------------


def load_served_params(model_dir: Path) -> Tuple[dict, Dict[str, torch.Tensor], bool]:
    """(HF config, SGLang TP-1 parameters, fp8) from a Hugging Face directory (fp8 weights dequantised
    and re-quantised per SGLang parameter, as SGLang's block-fp8 loader ends up holding them)."""
    from safetensors.torch import load_file
    from sglang_reference import block_fp8, sglang_shard

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
    for name, t in sglang_shard(full, config, tp=1, rank=0).items():
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


# -- the server -----------------------------------------------------------------------------------------


class Server:
    def __init__(self, args: Dict[str, List[str]]):
        from megarl.generator.torch_engine.engine import TorchEngine
        from megarl.models.spec import LlamaSpec

        if args.get("tp_size", ["1"]) != ["1"]:
            sys.exit("sglang_test_server: serves TP 1 only")
        config, self.params, self.fp8 = load_served_params(Path(args["model_path"][0]))
        spec = LlamaSpec.from_hf_config(config, source="sglang_test_server")
        self.model = ServedModel(self.params)
        self.version = (args.get("weight_version") or ["default"])[0]
        self.engine = TorchEngine(
            spec,
            self.params,
            max_running=64,
            max_seq_len=1024,
            version=int(self.version) if self.version.isdigit() else 0,
        )
        self.loaders = set(args.get("custom_weight_loader", []))
        self.lock = threading.Condition()
        self.paused = False
        self.session = False
        self.waiters: Dict[str, dict] = {}
        self.stats = {
            "pid": os.getpid(),
            "requests": {},
            "generated": 0,
            "aborted": 0,
            "updates": 0,
            "versions": [],
            "two_version_samples": 0,
        }
        self.stats_file = os.environ.get("SGLANG_TEST_STATS")
        self.stats_lock = threading.Lock()
        sglang_source.server_arg_fields()  # fail at start, not at the first request, if SGLang is missing
        self.fields = {
            route: set(sglang_source.class_fields("managers/io_struct.py", t)) for route, t in ROUTE_TYPES.items()
        }
        self.sampling_fields = set(sglang_source.class_fields("sampling/sampling_params.py", "SamplingParams"))
        self.allowed = sglang_source.safe_unpickler_globals()
        self.spans = sglang_source.span_functions()
        threading.Thread(target=self._loop, daemon=True).start()

    # the decode loop: one engine step at a time, never while paused in place
    def _loop(self) -> None:
        delay = float(os.environ.get("SGLANG_TEST_STEP_DELAY_S", "0"))
        while True:
            with self.lock:
                while self.paused or not (self.engine.waiting or self.engine.running or self.engine.aborted):
                    self.lock.wait()
                for c in self.engine.step():
                    waiter = self.waiters.pop(c.request_id)
                    waiter["completion"] = c
                    waiter["done"].set()
            if delay:
                time.sleep(delay)

    def save_stats(self) -> None:
        if self.stats_file:
            with self.stats_lock:
                tmp = self.stats_file + ".tmp"
                Path(tmp).write_text(json.dumps(self.stats))
                os.replace(tmp, self.stats_file)

    def validate(self, route: str, body: dict) -> None:
        unknown = set(body) - self.fields[route]
        if unknown:
            raise ValueError(f"{route}: fields {sorted(unknown)} are not in SGLang's {ROUTE_TYPES[route]}")
        if route == "/generate":
            unknown = set(body.get("sampling_params", {})) - self.sampling_fields
            if unknown:
                raise ValueError(f"/generate: sampling_params {sorted(unknown)} are not SGLang SamplingParams fields")
        self.stats["requests"][route] = self.stats["requests"].get(route, 0) + 1

    def generate(self, body: dict) -> dict:
        from megarl.generator.interface import GenerationRequest, SamplingParams

        sp = body["sampling_params"]
        if not body.get("return_logprob") or not isinstance(body.get("input_ids"), list):
            raise ValueError("/generate: megarl must send input_ids and return_logprob")
        params = SamplingParams(
            temperature=sp.get("temperature", 1.0),
            top_p=sp.get("top_p", 1.0),
            top_k=max(sp.get("top_k", -1), 0),
            max_new_tokens=sp["max_new_tokens"],
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            seed=sp.get("sampling_seed"),
        )
        rid = body["rid"]
        waiter = {"done": threading.Event()}
        with self.lock:
            self.waiters[rid] = waiter
            self.engine.submit([GenerationRequest(rid, body["input_ids"], params)])
            self.lock.notify_all()
        waiter["done"].wait()
        c = waiter["completion"]
        n = len(c.output_ids)
        if c.finish_reason == "abort":
            finish = {"type": "abort", "message": "Abort before prefill" if not n else "aborted by request"}
            self.stats["aborted"] += 1
        elif c.finish_reason == "length":
            finish = {"type": "length", "length": n}
        else:
            finish = {"type": "stop", "matched": c.output_ids[-1]}
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": n,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(c.logprobs, c.output_ids)],
        }
        # SGLang records an event (old version, tokens so far) at each update and builds spans from them
        events = [
            self.spans["WeightVersionEvent"](str(c.versions[i - 1]), i)
            for i in range(1, n)
            if c.versions[i] != c.versions[i - 1]
        ]
        current = str(c.versions[-1]) if n else self.version
        self.spans["add_weight_versions_to_meta_info"](
            meta, self.spans["compute_weight_version_spans"](events, current, n), n
        )
        self.stats["generated"] += n
        self.stats["two_version_samples"] += bool(events)
        return {"text": "", "output_ids": c.output_ids, "meta_info": meta}

    def control(self, route: str, body: dict) -> dict:
        if route == "/pause_generation":
            if body.get("mode") != "in_place":
                raise ValueError("megarl pauses in place (other modes abort or retract requests)")
            with self.lock:  # taken between two engine steps
                self.paused = True
            return {"message": "Generation paused successfully.", "status": "ok"}
        if route == "/continue_generation":
            with self.lock:
                self.paused = False
                self.lock.notify_all()
            return {"message": "Generation continued successfully.", "status": "ok"}
        if route == "/begin_weight_update":
            self.session = True
            return {"success": True, "message": ""}
        if route == "/end_weight_update":
            self.session = False
            return {"success": True, "message": ""}
        if route == "/abort_request":
            with self.lock:
                self.engine.abort([body["rid"]])
                self.lock.notify_all()
            return {}
        if route == "/update_weight_version":
            if body.get("abort_all_requests", True):
                raise ValueError("update_weight_version would abort every paused request (abort_all_requests)")
            self.version = body["new_version"]
            self.stats["versions"].append(self.version)
            return {
                "success": True,
                "message": f"Weight version updated to {self.version}",
                "new_version": self.version,
            }
        if route == "/update_weights_from_tensor":
            return self.update_weights(body)
        raise ValueError(f"no route {route}")

    def update_weights(self, body: dict) -> dict:
        if not self.session:
            return {
                "success": False,
                "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            }
        if not self.paused:
            raise ValueError("megarl updates weights of a paused server only")
        if body.get("load_format") not in self.loaders:
            raise ValueError(f"load_format {body.get('load_format')!r} was not given as --custom-weight-loader")
        if body.get("flush_cache", True) or body.get("abort_all_requests", False):
            raise ValueError("an in-flight update keeps the KV cache and the requests (flush_cache/abort false)")
        allowed = self.allowed

        class SafeUnpickler(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) not in allowed:
                    raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
                return super().find_class(module, name)

        named = SafeUnpickler(io.BytesIO(base64.b64decode(body["serialized_named_tensors"][0]))).load()
        named = [(name, tensor.to("cpu")) for name, tensor in named]
        module, _, fn = body["load_format"].rpartition(".")
        loader = getattr(importlib.import_module(module), fn)
        version = body.get("weight_version") or self.version
        with self.lock:
            self.engine.update_weights(
                lambda: (loader(self.model, named), types.SimpleNamespace(version=int(version)))[1]
            )
        self.version = version
        self.stats["updates"] += 1
        return {"success": True, "message": "Success"}


def make_handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _answer(self, code: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path in ("/health", "/health_generate"):
                self._answer(200, {})
            elif self.path == "/test_stats":
                self._answer(200, server.stats)
            else:
                self._answer(404, {"detail": "Not Found"})

        def do_POST(self):
            route = self.path
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if route not in ROUTE_TYPES:
                    return self._answer(404, {"detail": "Not Found"})
                server.validate(route, body)
                answer = server.generate(body) if route == "/generate" else server.control(route, body)
                ok = not (isinstance(answer, dict) and answer.get("success") is False)
                server.save_stats()
                self._answer(200 if ok else 400, answer)
            except Exception as e:  # SGLang answers 400 with a message; so does this server
                print(f"sglang_test_server: {route}: {e!r}", flush=True)
                self._answer(400, {"success": False, "message": f"{type(e).__name__}: {e}"})

    return Handler


def main(argv: List[str]) -> None:
    # what SGLang's TP worker offers a custom loader; this server is TP rank 0 of 1
    sys.modules["sglang.srt.distributed"] = types.SimpleNamespace(get_tensor_model_parallel_rank=lambda: 0)
    args = parse_args(argv)
    torch.set_num_threads(1)
    server = Server(args)
    server.save_stats()
    host, port = (args.get("host") or ["127.0.0.1"])[0], int(args["port"][0])
    httpd = ThreadingHTTPServer((host, port), make_handler(server))
    httpd.daemon_threads = True
    print(f"sglang_test_server: serving {args['model_path'][0]} on http://{host}:{port}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
