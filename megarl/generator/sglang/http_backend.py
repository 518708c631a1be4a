"""SglangBackend: megarl's GeneratorBackend over one SGLang HTTP server (one generator replica).

Each sample is one ``POST /generate`` (SGLang batches them on the server); a
thread pool keeps up to ``max_inflight`` of them open, so the server's
continuous batching always has work and a finished sample's slot refills at
once (the executor submits up to ``generator.max_running`` plus one group).
``step()`` returns what finished since the last call. ``abort`` posts
``/abort_request`` for the samples of the named requests; they come back with
finish_reason "abort". A weight update runs SGLang 0.5.x's in-flight protocol
(see ``protocol``): pause in place, begin, the transfer, end, set the version
(without aborting), continue -- requests in flight keep their KV cache and
later tokens carry the new version.

A watchdog thread checks the server between requests: a launched server's
process exiting, or ``/health`` not answering within ``health_timeout_s``,
ends this rank at once (``runtime.failure.fail_rank``) with a message naming
the replica, the URL and the server's log, so a dead server never hangs the
job in a collective.

Only the standard library talks HTTP; SGLang itself is never imported here.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence

from megarl.errors import MegarlError
from megarl.generator.interface import ABORTED, Completion, GenerationRequest, GeneratorBackend
from megarl.generator.sglang import protocol


class SglangServerError(MegarlError):
    """An SGLang server cannot be reached, died, or refused a request; names the server."""


def post(url: str, path: str, body: Dict, timeout_s: float, who: Optional[str] = None) -> Dict:
    """POST JSON; SglangServerError naming ``who`` (default: the URL) and the route on failure."""
    who = who or f"server {url}"
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as e:
        raise SglangServerError(f"{who}: {path} answered HTTP {e.code}: {e.read().decode()[:500]}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        raise SglangServerError(f"{who}: {path} failed: {e}") from None
    return json.loads(text) if text.strip() else {}


def get_ok(url: str, path: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
        return False


class SglangBackend(GeneratorBackend):
    def __init__(
        self,
        url: str,
        replica: int = 0,
        max_inflight: int = 256,
        request_timeout_s: float = 3600.0,
        control_timeout_s: float = 600.0,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 60.0,
        server=None,
        on_failure: Optional[Callable[[str], None]] = None,
        routes: Optional[protocol.RoutedExpertsLayout] = None,
    ):
        """``server``: the SglangServer this job launched for the replica (None when attached);
        ``on_failure(message)``: what the watchdog does about a dead server (default: end the rank);
        ``routes``: ask for every sample's routed experts (routing replay), laid out so."""
        self.url = url.rstrip("/")
        self.routes = routes
        self.replica = replica
        self.name = f"SGLang server of generator replica {replica} ({self.url})"
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.server = server
        self.version: Optional[int] = None
        self.pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix=f"sglang-r{replica}")
        self.done: "queue.Queue" = queue.Queue()
        self.lock = threading.Lock()
        self.inflight: Dict[str, GenerationRequest] = {}  # sample rid -> its request
        self.aborting: set = set()  # sample rids megarl asked to abort
        self.generated_tokens = 0
        self.started = time.perf_counter()
        self.updating = threading.Event()  # the watchdog leaves /health alone while paused
        self.closed = threading.Event()
        self.failure: Optional[str] = None
        self.on_failure = on_failure
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.watchdog = threading.Thread(target=self._watch, name=f"sglang-watchdog-r{replica}", daemon=True)
        self.watchdog.start()

    # -- generation ------------------------------------------------------------------------------

    def submit(self, requests: List[GenerationRequest]) -> None:
        self._check()
        for r in requests:
            r.params.validate()
            for i in range(r.n):
                rid = protocol.sample_rid(r, i)
                with self.lock:
                    self.inflight[rid] = r
                self.pool.submit(self._generate, r, i)

    def _generate(self, request: GenerationRequest, index: int) -> None:
        rid = protocol.sample_rid(request, index)
        try:
            payload = protocol.generate_payload(request, index, routed_experts=self.routes is not None)
            out = post(self.url, "/generate", payload, self.request_timeout_s, self.name)
            c = protocol.parse_generate_output(out, request, index, self.url, self.version or 0, self.routes)
            if c.finish_reason == ABORTED and rid not in self.aborting:
                raise SglangServerError(
                    f"{self.name}: request {rid} was aborted by the server, not by megarl: "
                    f"{out.get('meta_info', {}).get('finish_reason')}"
                )
            self.done.put(c)
        except BaseException as e:  # surfaced by the next step(): never lose a failure in a thread
            self.done.put(
                self._explain(e if isinstance(e, MegarlError) else SglangServerError(f"{self.name}: {rid}: {e!r}"))
            )
        finally:
            with self.lock:
                self.inflight.pop(rid, None)
                self.aborting.discard(rid)

    def step(self, wait_s: float = 0.05) -> List[Completion]:
        self._check()
        finished: List[Completion] = []
        try:
            item = self.done.get(timeout=wait_s)
            while True:
                if isinstance(item, BaseException):
                    raise item
                finished.append(item)
                if item.finish_reason != ABORTED:
                    self.generated_tokens += len(item.output_ids)
                item = self.done.get_nowait()
        except queue.Empty:
            pass
        return finished

    def abort(self, request_ids: Sequence[str]) -> None:
        wanted = set(request_ids)
        with self.lock:
            rids = [rid for rid, r in self.inflight.items() if r.request_id in wanted and rid not in self.aborting]
            self.aborting.update(rids)
        for rid in rids:  # an abort of a request that just finished is a no-op on SGLang's side
            self._control("/abort_request", protocol.abort_payload(rid))

    # -- weight updates --------------------------------------------------------------------------

    def _control(self, path: str, body: Dict) -> Dict:
        try:
            answer = post(self.url, path, body, self.control_timeout_s, self.name)
        except SglangServerError as e:
            raise self._explain(e) from None
        protocol.check_ok(answer, self.name, path)
        return answer

    def _explain(self, err: MegarlError) -> MegarlError:
        """A failed request to a launched server that has exited: say so, and where its log is."""
        if self.server is not None and self.server.exited(wait_s=1.0) is not None:
            return SglangServerError(
                f"{self.name} exited with code {self.server.exited()} ({err}); its log: {self.server.log_path}"
            )
        return err

    def update_weights(self, apply: Callable[[], object]):
        """In-flight update: ``apply()`` triggers the transfer (megarl's receiver in every TP
        worker) and returns its SyncStats; the version that landed is set on the server."""
        self._check()
        self.updating.set()
        try:
            self._control("/pause_generation", protocol.PAUSE_IN_PLACE)  # answered once the scheduler stopped
            self._control("/begin_weight_update", {})
            stats = apply()
            self._control("/end_weight_update", {})
            self._control("/update_weight_version", protocol.update_version_payload(stats.version))
            self.version = int(stats.version)
            self._control("/continue_generation", {})
        finally:
            self.updating.clear()
        return stats

    def post_weights_trigger(self, version: int, tp: int, loader: str) -> None:
        """Run megarl's receiver (``loader``) in every TP worker of this server, for ``version``."""
        self._control("/update_weights_from_tensor", protocol.sync_trigger_payload(version, self.replica, tp, loader))

    # -- health ----------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self.closed.wait(self.health_interval_s):
            problem = None
            if self.server is not None and self.server.exited(wait_s=1.0) is not None:
                problem = f"{self.name} exited with code {self.server.exited()}"
            elif not self.updating.is_set() and not get_ok(self.url, "/health", self.health_timeout_s):
                if self.closed.is_set() or self.updating.is_set():
                    continue
                problem = f"{self.name} did not answer /health within {self.health_timeout_s:.0f} s"
            if problem:
                if self.closed.is_set():  # close() stopped the server while this check waited on it
                    return
                if self.server is not None:
                    problem += f"; its log: {self.server.log_path}"
                self.failure = problem
                if self.on_failure is not None:
                    self.on_failure(problem)
                return

    def _check(self) -> None:
        if self.failure:
            raise SglangServerError(self.failure)

    def stats(self) -> Dict[str, float]:
        with self.lock:
            inflight = len(self.inflight)
        elapsed = time.perf_counter() - self.started
        return {
            "queue_depth": 0,
            "running": inflight + self.done.qsize(),
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": self.generated_tokens / elapsed if elapsed else 0.0,
            "version": self.version,
        }

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()
