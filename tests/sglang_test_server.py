"""A protocol test server that speaks SGLang 0.5.23's HTTP routes, for megarl's CPU tests only.

SGLang cannot run without a GPU, so the end-to-end tests start this script
exactly where megarl starts ``python -m sglang.launch_server`` (launch mode:
``generator.sglang_launcher``) or point ``generator.sglang_urls`` at it
(attach mode). It holds to SGLang's side of the contract, read from SGLang's
own installed source (tests/sglang_source.py, tests/sglang_contract.py):

- every command-line flag must be a ServerArgs field;
- the routes are SGLang's: http_server.py's decorated handlers give each
  route its methods and the class its body is parsed into; a route SGLang
  does not serve is a 404, a method it does not serve a 405;
- every request body must be one SGLang's class for that route accepts: only
  its fields, every field without a default present, each value of the
  field's annotated type (GenerateReqInput + SamplingParams,
  PauseGenerationReqInput's mode Literal, AbortReq,
  UpdateWeightsFromTensorReqInput's base64 bytes, ...); anything else is a 400
  with SGLang's error shape;
- ``/update_weights_from_tensor`` runs in every TP worker (``--tp-size``;
  tests/sglang_test_worker.py): worker r deserialises
  ``serialized_named_tensors[r]`` with SGLang's SafeUnpickler allow-list and
  calls the custom weight loader named by ``load_format`` (which must have
  been given with --custom-weight-loader) as SGLang calls it,
  ``loader(model, named_tensors)`` with ``model.named_parameters()`` its own
  shard in SGLang's names -- i.e. megarl's ``worker_receiver.pull_shards``,
  which joins the trainer's sync group as sync rank T + r;
- in-place pause keeps requests and their KV cache; updates happen only
  inside begin/end_weight_update; per-token versions are reported with
  SGLang's own span code (``weight_versions`` spans, ``weight_version``).

With ``--ep-size`` the workers hold SGLang's FusedMoE expert layout; with
``--enable-return-routed-experts`` an answer to a request with
``return_routed_experts`` carries ``meta_info.routed_experts`` as SGLang encodes it
(int32 base64, dense layers 0).

It decodes with megarl's torch engine at each TP rank over the SGLang-layout
shards, loaded from --model-path by tests/sglang_reference.py (written from
SGLang's loaders, independently of megarl's layouts). Routes SGLang serves but
megarl never calls answer 501. Test-only routes (not SGLang's; only the tests
read them): GET /test_stats reports what it served (also written after every
request to the file named by SGLANG_TEST_STATS when set); GET /test_dump_params
has every TP worker save its parameters under SGLANG_TEST_DUMP_DIR. The
environment variable SGLANG_TEST_STEP_DELAY_S adds that many seconds to every
decode step: a GPU generator is slower than a tiny model's trainer, which is
what makes weight updates land in the middle of sequences.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests import sglang_contract, sglang_source  # noqa: E402
from tests.sglang_test_worker import TPWorker, present_tp_rank, serve  # noqa: E402

BOOLEAN_FLAGS = {"skip_server_warmup", "skip_tokenizer_init", "enable_return_routed_experts"}


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


def sglang_routed_experts(routes: torch.Tensor, start_len: int) -> str:
    """The engine's routes ([fed positions, layers, top_k], -1 on dense layers) as SGLang answers them:
    int32 rows from ``start_len``, dense layers 0 (its capture buffer starts zeroed and only MoE
    layers write it), base64 of the raw bytes (tokenizer_manager.py under --skip-tokenizer-init)."""
    import base64

    rows = routes[start_len:].to(torch.int32).clamp(min=0)
    return base64.b64encode(rows.numpy().tobytes()).decode("utf-8")


class NotModelled(Exception):
    """An SGLang route or option this test server does not implement (megarl does not use it)."""


# -- the TP workers -------------------------------------------------------------------------------------


class LocalWorkers:
    """TP 1: the one worker in this process."""

    def __init__(self, worker: TPWorker):
        self.workers = [worker]
        self.pids = [os.getpid()]

    def call(self, method: str, per_rank: List[tuple]) -> list:
        return [getattr(self.workers[0], method)(*per_rank[0])]


class ProcessWorkers:
    """TP > 1: one process per worker; every call goes to all of them at once (they run collectives
    together: the engine's all-reduces, the loader's sync group) and waits for every answer."""

    def __init__(self, model_dir: str, tp: int, version: int, max_running: int, allowed: set, ep: int = 1):
        from megarl.runtime.ports import free_port

        ctx = multiprocessing.get_context("fork")  # before any thread of this process starts
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=serve,
                args=(child, model_dir, tp, rank, port, version, max_running, allowed, ep),
                name=f"sglang-test-tp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()  # the worker's end: its exit then reads as EOF here
            self.conns.append(parent)
            self.procs.append(proc)
        self.pids = [self._answer(rank) for rank in range(tp)]

    def _answer(self, rank: int):
        try:
            status, value = self.conns[rank].recv()
        except EOFError:
            raise RuntimeError(f"TP worker {rank} exited (code {self.procs[rank].exitcode})") from None
        if status == "error":
            raise RuntimeError(f"TP worker {rank}: {value}")
        return value

    def call(self, method: str, per_rank: List[tuple]) -> list:
        for conn, args in zip(self.conns, per_rank):
            conn.send((method, args))
        return [self._answer(rank) for rank in range(len(self.conns))]


# -- the server -----------------------------------------------------------------------------------------


class Server:
    def __init__(self, args: Dict[str, List[str]]):
        self.tp = int((args.get("tp_size") or ["1"])[0])
        ep = int((args.get("ep_size") or ["1"])[0])
        self.version = (args.get("weight_version") or ["default"])[0]
        self.loaders = set(args.get("custom_weight_loader", []))
        # SGLang captures routes only when started so; a request asking without it gets none, silently
        self.routed_experts = "enable_return_routed_experts" in args
        max_running = int((args.get("max_running_requests") or ["64"])[0])
        model_dir = args["model_path"][0]
        self.allowed = sglang_source.safe_unpickler_globals()
        self.spans = sglang_source.span_functions()
        # read at start (so a missing SGLang source fails here, not at the first request)
        self.pause_default = sglang_contract.route_fields("/pause_generation")["mode"].default_value()
        version = int(self.version) if self.version.isdigit() else 0
        if self.tp == 1:
            present_tp_rank(0)
            self.workers = LocalWorkers(TPWorker(model_dir, 1, 0, None, version, max_running, self.allowed))
        else:
            self.workers = ProcessWorkers(model_dir, self.tp, version, max_running, self.allowed, ep)
        self.lock = threading.Condition()
        self.paused = False
        self.session = False
        self.busy = False  # the workers have requests waiting, running or aborted
        self.new_requests: list = []
        self.new_aborts: List[str] = []
        self.fed: List[List[int]] = []  # every answered request's fed ids (meta_info.cached_tokens)
        self.waiters: Dict[str, dict] = {}
        self.failure = None
        self.stats = {
            "pid": os.getpid(),
            "tp_size": self.tp,
            "worker_pids": self.workers.pids,
            "requests": {},
            "generated": 0,
            "aborted": 0,
            "aborted_rids": [],  # as /abort_request named them
            "finished_rids": [],  # answered with a stop or length finish
            "pause_modes": {},
            "updates": 0,
            "worker_loads": [0] * self.tp,
            "versions": [],
            "two_version_samples": 0,
        }
        self.stats_file = os.environ.get("SGLANG_TEST_STATS")
        self.stats_lock = threading.Lock()
        self.routes = {
            "/generate": self.generate,
            "/pause_generation": self.pause,
            "/continue_generation": self.continue_generation,
            "/begin_weight_update": self.begin_weight_update,
            "/end_weight_update": self.end_weight_update,
            "/abort_request": self.abort_request,
            "/update_weight_version": self.update_weight_version,
            "/update_weights_from_tensor": self.update_weights_from_tensor,
        }
        threading.Thread(target=self._loop, daemon=True).start()

    # the decode loop: one step of every worker at a time, never while paused in place
    def _loop(self) -> None:
        delay = float(os.environ.get("SGLANG_TEST_STEP_DELAY_S", "0"))
        while self.failure is None:
            with self.lock:
                while self.paused or not (self.busy or self.new_requests or self.new_aborts):
                    self.lock.wait()
                work = (self.new_requests, self.new_aborts)
                self.new_requests, self.new_aborts = [], []
                try:
                    answers = self.workers.call("tick", [work] * self.tp)
                    done, self.busy = answers[0]
                    for rank, (other, _) in enumerate(answers[1:], 1):  # TP ranks sample the same tokens
                        if [(c.request_id, c.output_ids) for c in other] != [
                            (c.request_id, c.output_ids) for c in done
                        ]:
                            raise RuntimeError(f"TP worker {rank} finished other samples than TP worker 0")
                except Exception as e:  # every waiting request, and every later one, fails naming it
                    self.failure = f"decode step failed: {e}"
                    print(f"sglang_test_server: {self.failure}", flush=True)
                    done = []
                    for waiter in self.waiters.values():
                        waiter["done"].set()
                for c in done:
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

    def count(self, route: str) -> None:
        self.stats["requests"][route] = self.stats["requests"].get(route, 0) + 1

    def generate(self, body: dict) -> dict:
        from megarl.generator.interface import GenerationRequest, SamplingParams

        sp = body.get("sampling_params") or {}
        sglang_contract.check_sampling_params(sp)
        if not body.get("return_logprob") or not isinstance(body.get("input_ids"), list):
            raise NotModelled("/generate: megarl sends input_ids and return_logprob")
        params = SamplingParams(
            temperature=sp.get("temperature", 1.0),
            top_p=sp.get("top_p", 1.0),
            top_k=max(sp.get("top_k", -1), 0),
            max_new_tokens=sp.get("max_new_tokens", 128),  # SamplingParams' default
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
            seed=sp.get("sampling_seed"),
        )
        rid = body["rid"]
        waiter = {"done": threading.Event()}
        with self.lock:
            if self.failure:
                raise RuntimeError(self.failure)
            self.waiters[rid] = waiter
            self.new_requests.append(GenerationRequest(rid, body["input_ids"], params))
            self.lock.notify_all()
        waiter["done"].wait()
        if "completion" not in waiter:
            raise RuntimeError(self.failure)
        c = waiter["completion"]
        n = len(c.output_ids)
        if c.finish_reason == "abort":
            finish = {"type": "abort", "message": "Abort before prefill" if not n else "aborted by request"}
            self.stats["aborted"] += 1
        else:
            finish = (
                {"type": "length", "length": n}
                if c.finish_reason == "length"
                else {"type": "stop", "matched": c.output_ids[-1]}
            )
            self.stats["finished_rids"].append(rid)
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": n,
            "cached_tokens": self._radix_hit(body["input_ids"], c),
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
        if body.get("return_routed_experts") and self.routed_experts and c.routed_experts is not None:
            meta["routed_experts"] = sglang_routed_experts(c.routed_experts, body.get("routed_experts_start_len", 0))
            self.stats["routed_experts_answers"] = self.stats.get("routed_experts_answers", 0) + 1
        self.stats["generated"] += n
        self.stats["two_version_samples"] += bool(events)
        return {"text": "", "output_ids": c.output_ids, "meta_info": meta}

    def _radix_hit(self, input_ids, completion) -> int:
        """meta_info.cached_tokens as a radix cache that never evicts would report it: the longest
        prefix of this prompt that an earlier request fed (its prompt and all but its last output id),
        at most all but the prompt's last id (SGLang always prefills at least one)."""
        best = 0
        with self.lock:
            for fed in self.fed:
                n = 0
                while n < min(len(fed), len(input_ids) - 1) and fed[n] == input_ids[n]:
                    n += 1
                best = max(best, n)
            self.fed.append(list(input_ids) + list(completion.output_ids[:-1]))
        return best

    def pause(self, body: dict) -> dict:
        # the contract checked the value against PauseGenerationReqInput's Literal
        mode = body.get("mode", self.pause_default)
        self.stats["pause_modes"][mode] = self.stats["pause_modes"].get(mode, 0) + 1
        if mode != "in_place":
            raise NotModelled(f"pause_generation mode {mode!r}: megarl pauses in place only")
        with self.lock:  # taken between two engine steps
            self.paused = True
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> dict:
        with self.lock:
            self.paused = False
            self.lock.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def begin_weight_update(self, body: dict) -> dict:
        self.session = True
        return {"success": True, "message": ""}

    def end_weight_update(self, body: dict) -> dict:
        self.session = False
        return {"success": True, "message": ""}

    def abort_request(self, body: dict) -> dict:
        if body.get("abort_all"):
            raise NotModelled("abort_request abort_all: megarl aborts by rid")
        with self.lock:
            self.new_aborts.append(body.get("rid") or "")
            self.stats["aborted_rids"].append(body.get("rid") or "")
            self.lock.notify_all()
        return {}

    def update_weight_version(self, body: dict) -> dict:
        if body.get("abort_all_requests", True):
            raise NotModelled("update_weight_version would abort every paused request (abort_all_requests)")
        self.version = body["new_version"]
        if self.version.isdigit():  # SGLang's scheduler reports the new version from here on
            with self.lock:
                self.workers.call("set_version", [(int(self.version),)] * self.tp)
        self.stats["versions"].append(self.version)
        return {"success": True, "message": f"Weight version updated to {self.version}", "new_version": self.version}

    def update_weights_from_tensor(self, body: dict) -> dict:
        if not self.session:
            return {
                "success": False,
                "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            }
        if not self.paused:
            raise NotModelled("megarl updates weights of a paused server only")
        load_format = body.get("load_format")
        if load_format not in self.loaders:
            raise ValueError(f"load_format {load_format!r} was not given as --custom-weight-loader")
        if body.get("flush_cache", True) or body.get("abort_all_requests", False):
            raise NotModelled("an in-flight update keeps the KV cache and the requests (flush_cache/abort false)")
        blobs = body["serialized_named_tensors"]
        if len(blobs) < self.tp:  # SGLang's TP worker r reads entry r
            raise IndexError(f"serialized_named_tensors has {len(blobs)} entries for {self.tp} TP workers")
        version = body.get("weight_version") or self.version
        with self.lock:
            loads = self.workers.call("load", [(load_format, blobs[r], int(version)) for r in range(self.tp)])
        self.version = version
        self.stats["updates"] += 1
        self.stats["worker_loads"] = loads
        return {"success": True, "message": "Success"}

    def dump_params(self) -> dict:
        out = os.environ.get("SGLANG_TEST_DUMP_DIR")
        if not out:
            raise NotModelled("set SGLANG_TEST_DUMP_DIR to dump the workers' parameters")
        with self.lock:
            return {"files": self.workers.call("dump", [(out,)] * self.tp)}


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

        def _refuse(self, route: str, err: sglang_contract.ContractError) -> None:
            print(f"sglang_test_server: {route}: {err}", flush=True)
            if isinstance(err, sglang_contract.UnknownRoute):  # FastAPI's answers
                return self._answer(404, {"detail": "Not Found"})
            if isinstance(err, sglang_contract.WrongMethod):
                return self._answer(405, {"detail": "Method Not Allowed"})
            # SGLang's answer to a body its request class refuses (http_server.py: 400, ErrorResponse)
            self._answer(400, {"object": "error", "message": str(err), "type": "Bad Request", "code": 400})

        def do_GET(self):
            route = self.path.split("?")[0]
            if route == "/test_stats":
                return self._answer(200, server.stats)
            if route == "/test_dump_params":
                try:
                    return self._answer(200, server.dump_params())
                except Exception as e:
                    return self._answer(400, {"success": False, "message": f"{type(e).__name__}: {e}"})
            try:
                sglang_contract.check_request(route, "GET", None)
            except sglang_contract.ContractError as e:
                return self._refuse(route, e)
            if route in ("/health", "/health_generate"):
                return self._answer(200, {})
            self._answer(501, {"detail": f"sglang_test_server does not model GET {route}"})

        def do_POST(self):
            route = self.path.split("?")[0]
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                sglang_contract.check_request(route, "POST", body)
                if route not in server.routes:
                    raise NotModelled(f"sglang_test_server does not model POST {route}")
                server.count(route)
                answer = server.routes[route](body)
            except sglang_contract.ContractError as e:
                return self._refuse(route, e)
            except NotModelled as e:
                print(f"sglang_test_server: {route}: {e}", flush=True)
                return self._answer(501, {"success": False, "message": f"not modelled: {e}"})
            except Exception as e:  # SGLang answers 400 with a message; so does this server
                print(f"sglang_test_server: {route}: {e!r}", flush=True)
                return self._answer(400, {"success": False, "message": f"{type(e).__name__}: {e}"})
            ok = not (isinstance(answer, dict) and answer.get("success") is False)
            server.save_stats()
            self._answer(200 if ok else 400, answer)

    return Handler


def main(argv: List[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    server = Server(args)
    server.save_stats()
    host, port = (args.get("host") or ["127.0.0.1"])[0], int(args["port"][0])
    httpd = ThreadingHTTPServer((host, port), make_handler(server))
    httpd.daemon_threads = True
    print(f"sglang_test_server: serving {args['model_path'][0]} at TP {server.tp} on http://{host}:{port}", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
