"""SglangBackend: megarl's GeneratorBackend over SGLang HTTP servers, one per generator replica.

Each sample is one ``POST /generate`` (SGLang batches them on the server);
a small thread pool per server keeps up to ``max_inflight`` requests open, so
the server's continuous batching always has work. ``step()`` returns what has
finished since the last call. Weight updates run SGLang 0.5.x's in-flight
protocol on every server (see ``protocol``): pause in place on all servers
first, then begin / transfer / end, set the version, continue -- requests in
flight keep their KV cache and later tokens carry the new version.

Only the standard library talks HTTP; SGLang itself is imported only where
the transfer needs its serializer (GPU machines).
"""

from __future__ import annotations

import base64
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Sequence

from megarl.errors import MegarlError
from megarl.generator.interface import Completion, GenerationRequest, GeneratorBackend
from megarl.generator.sglang import protocol


class SglangServerError(MegarlError):
    """An SGLang server cannot be reached or refused a request; names the server."""


def post(url: str, path: str, body: Dict, timeout_s: float) -> Dict:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as e:
        raise SglangServerError(f"server {url}: {path} answered HTTP {e.code}: {e.read().decode()[:500]}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise SglangServerError(f"server {url}: {path} failed: {e}") from None
    return json.loads(text) if text.strip() else {}


def sync_trigger_payload(version: int, replica: int, tp: int) -> Dict:
    """``/update_weights_from_tensor`` body that runs megarl's receiver in every TP worker.

    The one tensor is a header (version, replica); SGLang hands it to the
    custom loader named by ``load_format`` in each TP worker. Serialised
    with SGLang's own MultiprocessingSerializer, base64 for JSON, one
    payload per TP rank (each deserialises only its own).
    """
    import torch
    from sglang.srt.utils import MultiprocessingSerializer  # GPU machines only

    from megarl.generator.sglang.serving import WORKER_LOADER

    header = [("megarl_sync", torch.tensor([version, replica], dtype=torch.int64))]
    blob = base64.b64encode(MultiprocessingSerializer.serialize(header)).decode()
    return {"serialized_named_tensors": [blob] * tp, "load_format": WORKER_LOADER, "flush_cache": False,
            "abort_all_requests": False, "weight_version": str(version)}


class SglangBackend(GeneratorBackend):
    def __init__(self, urls: Sequence[str], tp: int = 1, max_inflight: int = 256, request_timeout_s: float = 3600.0,
                 control_timeout_s: float = 600.0, version: int = 0):
        if not urls:
            raise MegarlError("generator.sglang_urls is empty: give one server URL per generator replica")
        self.urls = [u.rstrip("/") for u in urls]
        self.tp = tp
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.version = version
        self.pools = [ThreadPoolExecutor(max_workers=max_inflight) for _ in self.urls]
        self.inflight = [0] * len(self.urls)
        self.done: "queue.Queue" = queue.Queue()
        self.lock = threading.Lock()
        self.generated_tokens = 0
        self.started = time.perf_counter()
        self.errors: List[BaseException] = []

    # -- generation ------------------------------------------------------------------------------

    def submit(self, requests: List[GenerationRequest]) -> None:
        for r in requests:
            r.params.validate()
            for i in range(r.n):
                with self.lock:  # least-loaded server
                    server = min(range(len(self.urls)), key=lambda s: self.inflight[s])
                    self.inflight[server] += 1
                self.pools[server].submit(self._generate, server, r, i)

    def _generate(self, server: int, request: GenerationRequest, index: int) -> None:
        url = self.urls[server]
        try:
            out = post(url, "/generate", protocol.generate_payload(request, index), self.request_timeout_s)
            self.done.put(protocol.parse_generate_output(out, request, index, url, self.version))
        except BaseException as e:  # surfaced by the next step(): never lose a failure in a thread
            self.done.put(e)
        finally:
            with self.lock:
                self.inflight[server] -= 1

    def step(self, wait_s: float = 0.05) -> List[Completion]:
        finished: List[Completion] = []
        try:
            item = self.done.get(timeout=wait_s)
            while True:
                if isinstance(item, BaseException):
                    raise item
                finished.append(item)
                self.generated_tokens += len(item.output_ids)
                item = self.done.get_nowait()
        except queue.Empty:
            pass
        return finished

    # -- weight updates --------------------------------------------------------------------------

    def _post_all(self, path: str, bodies: Dict[int, Dict]) -> None:
        """POST ``bodies[s]`` to every server s at once; wait for every answer, raise the first failure."""
        answers: Dict[int, object] = {}

        def call(s: int) -> None:
            try:
                answers[s] = post(self.urls[s], path, bodies[s], self.control_timeout_s)
            except BaseException as e:
                answers[s] = e

        threads = [threading.Thread(target=call, args=(s,)) for s in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in bodies:
            if isinstance(answers[s], BaseException):
                raise answers[s]
            protocol.check_ok(answers[s], self.urls[s], path)

    def _control(self, path: str, body: Dict) -> None:
        self._post_all(path, {s: body for s in range(len(self.urls))})

    def pause(self) -> None:
        self._control("/pause_generation", protocol.PAUSE_IN_PLACE)

    def resume(self) -> None:
        self._control("/continue_generation", {})

    def update_weights(self, apply: Callable[[], object], version: int) -> None:
        """In-flight update on every replica: ``apply()`` performs the transfer.

        For megarl's shard-to-shard path, ``apply`` is ``trigger_shard_to_shard(version)``
        (the trainer ranks push concurrently); for the stock path it posts
        ``protocol.distributed_update`` buckets while rank 0 broadcasts them.
        """
        self.pause()  # answered only once every scheduler has stopped between decode steps
        self._control("/begin_weight_update", {})
        apply()
        self._control("/end_weight_update", {})
        self._control("/update_weight_version", protocol.update_version_payload(version))
        self.version = version
        self.resume()

    def trigger_shard_to_shard(self, version: int) -> Callable[[], None]:
        # the payload names the replica: one body per server, all posted at once
        return lambda: self._post_all("/update_weights_from_tensor", {
            r: sync_trigger_payload(version, r, self.tp) for r in range(len(self.urls))})

    def stats(self) -> Dict[str, float]:
        with self.lock:
            inflight = sum(self.inflight)
        elapsed = time.perf_counter() - self.started
        return {"queue_depth": 0, "running": inflight + self.done.qsize(), "generated_tokens": self.generated_tokens,
                "tokens_per_s": self.generated_tokens / elapsed if elapsed else 0.0, "version": self.version}

    def close(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)
