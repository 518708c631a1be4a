"""What megarl sends to an SGLang 0.5.x server and how it reads the answers.

Pure functions over JSON-able dicts, so they are tested on CPU against
SGLang's own request types (tests/unit/test_sglang_protocol.py reads the field
names from SGLang's io_struct.py / sampling_params.py and runs SGLang's own
weight-version-span code).

The weight-update protocol (SGLang 0.5.x, http_server.py), in order, per server:

1. ``POST /pause_generation {"mode": "in_place"}`` -- and wait for its answer:
   the scheduler stops between decode steps, running requests keep their KV
   cache. Nothing else may be sent before it answers.
2. ``POST /begin_weight_update {}`` -- restores in-place-packed (e.g. fp8
   post-processed) weights so new ones can be written.
3. the transfer: ``POST /update_weights_from_tensor`` with megarl's custom
   ``load_format`` runs megarl's shard-to-shard receiver inside every TP
   worker, which pulls its own shard from the trainer ranks that hold it
   (``worker_receiver``). SGLang's ``update_weights_from_distributed`` is not
   used: it broadcasts whole tensors from one rank -- the gather megarl exists
   to avoid -- and its Llama loader drops block-fp8 scales.
4. ``POST /end_weight_update {}`` -- re-runs the quantisation post-processing.
5. ``POST /update_weight_version {"new_version": V, "abort_all_requests": false}``
   -- its default ``abort_all_requests: true`` would abort every paused request.
6. ``POST /continue_generation {}``.

Tokens generated after step 6 report version V; a finished request's
``meta_info.weight_versions`` lists ``{"version", "start", "end"}`` spans over
its output tokens.

``backend.abort`` stops a request's samples with ``POST /abort_request
{"rid": ...}``; their ``/generate`` call then answers with
``finish_reason.type == "abort"``. (The loop's generator executor aborts
nothing for its age: groups in flight finish under in-flight updates.)

Routing replay (``trainer.moe_enable_routing_replay``): the server runs with
``--enable-return-routed-experts`` and each request asks ``return_routed_experts``
from ``routed_experts_start_len: 0``; ``meta_info.routed_experts`` is then the
base64 of an int32 array [prompt + output - 1, num_hidden_layers, top_k]
(state_capturer/routed_experts.py: every hidden layer, dense ones never written,
so 0), the experts of the forward that wrote each position's KV (a prefix-cache
hit keeps the routes of the forward that computed it).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Dict, List, Optional, Tuple

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's ForkingPickler reductions)

from megarl.errors import MegarlError
from megarl.generator.interface import ABORTED, Completion, GenerationRequest, SamplingParams

PAUSE_IN_PLACE = {"mode": "in_place"}


class SglangResponseError(MegarlError):
    """An SGLang server answered something megarl cannot use; names the server and request."""


@dataclass(frozen=True)
class RoutedExpertsLayout:
    """What ``meta_info.routed_experts`` holds per position, for a model: SGLang records every
    hidden layer; megarl marks the dense ones -1 (Completion.routed_experts)."""

    num_layers: int
    top_k: int
    num_experts: int
    moe_layers: Tuple[int, ...]

    @classmethod
    def of(cls, spec) -> "RoutedExpertsLayout":
        return cls(spec.num_layers, spec.moe.top_k, spec.moe.num_experts, tuple(spec.moe.layers))


def sampling_params(p: SamplingParams, sample_index: int) -> Dict:
    """SGLang's sampling_params for sample ``sample_index`` of a request.

    n samples of one prompt are sent as n requests (each its own rid and
    seed), so a sample does not depend on how the server batches them.
    """
    out = {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,  # SGLang: -1 = all tokens
        "max_new_tokens": p.max_new_tokens,
        "stop_token_ids": list(p.stop_token_ids),
        # token ids in, token ids out: no detokenisation-dependent stopping or trimming
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if p.seed is not None:
        out["sampling_seed"] = p.seed + sample_index
    return out


def sample_rid(request: GenerationRequest, sample_index: int) -> str:
    return f"{request.request_id}#{sample_index}"


def generate_payload(request: GenerationRequest, sample_index: int, routed_experts: bool = False) -> Dict:
    """Body of ``POST /generate`` for one sample.

    ``return_logprob`` with ``logprob_start_len: -1`` returns the log-prob of
    every output token only. SGLang's sampled-token log-prob is
    log_softmax(logits / temperature) -- the behaviour log-prob AIPO needs as
    long as top_p = 1 and top_k = 0 (megarl's RL defaults); with truncation
    SGLang does not renormalise, megarl's torch engine does. ``routed_experts``:
    every fed position's experts too (routing replay), from position 0.
    """
    payload = {
        "rid": sample_rid(request, sample_index),
        "input_ids": list(request.prompt_ids),
        "sampling_params": sampling_params(request.params, sample_index),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    if routed_experts:
        payload.update(return_routed_experts=True, routed_experts_start_len=0)
    return payload


def parse_routed_experts(meta: Dict, layout: RoutedExpertsLayout, positions: int, where: str) -> torch.Tensor:
    """``meta_info.routed_experts`` -> int16 [positions, num_layers, top_k], -1 on dense layers."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        raise SglangResponseError(
            f"{where}: the answer has no meta_info.routed_experts although return_routed_experts was sent "
            f"(SGLang drops it silently unless started with --enable-return-routed-experts)"
        )
    raw = base64.b64decode(encoded)
    per_position = layout.num_layers * layout.top_k
    if len(raw) != 4 * positions * per_position:
        raise SglangResponseError(
            f"{where}: routed_experts has {len(raw)} bytes, not the {positions} positions x "
            f"{layout.num_layers} layers x top-{layout.top_k} int32 of the prompt and output "
            f"(was routed_experts_start_len 0, or does the server serve another model?)"
        )
    routes = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(positions, layout.num_layers, layout.top_k)
    moe = torch.zeros(layout.num_layers, dtype=torch.bool)
    moe[list(layout.moe_layers)] = True
    bad = routes[:, moe]
    if bad.numel() and (bad.min() < 0 or bad.max() >= layout.num_experts):
        raise SglangResponseError(
            f"{where}: routed_experts has expert ids outside [0, {layout.num_experts}) on MoE layers"
        )
    out = routes.to(torch.int16)
    out[:, ~moe] = -1
    return out


def parse_version(version) -> int:
    """megarl's policy versions travel as SGLang weight_version strings ("7")."""
    try:
        return int(version)
    except (TypeError, ValueError):
        raise SglangResponseError(
            f"weight_version {version!r} is not a megarl policy version (an integer); was the server started "
            f"with --weight-version <int> and updated only by megarl?"
        ) from None


def token_versions(meta_info: Dict, n_tokens: int, server_version: int) -> List[int]:
    """Per-token versions from ``meta_info.weight_versions`` spans (absent: one version)."""
    spans = meta_info.get("weight_versions")
    if not spans:
        return [parse_version(meta_info.get("weight_version", server_version))] * n_tokens
    versions: List[int] = []
    for span in spans:
        if span["start"] != len(versions):
            raise SglangResponseError(f"weight_versions spans are not contiguous: {spans}")
        versions += [parse_version(span["version"])] * (span["end"] - span["start"])
    if len(versions) != n_tokens:
        raise SglangResponseError(f"weight_versions spans cover {len(versions)} of {n_tokens} output tokens: {spans}")
    return versions


def parse_generate_output(
    out: Dict,
    request: GenerationRequest,
    sample_index: int,
    server: str = "?",
    server_version: int = 0,
    routes: Optional[RoutedExpertsLayout] = None,
) -> Completion:
    """One ``/generate`` answer -> a Completion (tokens, behaviour log-probs, versions; with ``routes``
    the routed experts of every fed position)."""
    rid = sample_rid(request, sample_index)
    meta = out.get("meta_info")
    if meta is None or "output_ids" not in out:
        raise SglangResponseError(
            f"server {server}, request {rid}: answer has no output_ids/meta_info: {str(out)[:300]}"
        )
    output_ids = [int(t) for t in out["output_ids"]]
    entries = meta.get("output_token_logprobs")
    if entries is None or len(entries) != len(output_ids):
        raise SglangResponseError(
            f"server {server}, request {rid}: output_token_logprobs has "
            f"{None if entries is None else len(entries)} entries for {len(output_ids)} tokens "
            f"(was return_logprob sent?)"
        )
    logprobs = []
    for i, (entry, token) in enumerate(zip(entries, output_ids)):
        logprob, entry_token = entry[0], entry[1]  # [logprob, token_id, token_text or None]
        if int(entry_token) != token:
            raise SglangResponseError(
                f"server {server}, request {rid}: log-prob {i} is for token {entry_token}, output token is {token}"
            )
        logprobs.append(float(logprob))
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    # an abort megarl asked for (the caller checks that it did); its tokens are never trained on
    reason = ABORTED if kind == "abort" else "length" if kind == "length" else "stop"
    versions = token_versions(meta, len(output_ids), server_version)
    routed = None
    if routes is not None and reason != ABORTED:  # an aborted sample is never trained
        positions = len(request.prompt_ids) + len(output_ids) - 1
        routed = parse_routed_experts(meta, routes, positions, f"server {server}, request {rid}")
    return Completion(
        request.request_id,
        sample_index,
        request.group_id,
        list(request.prompt_ids),
        output_ids,
        logprobs,
        versions,
        reason,
        dict(request.meta),
        routed,
        # the prompt ids its radix cache held (TokenizerManager puts recv_obj.cached_tokens in meta_info)
        cached_tokens=int(meta.get("cached_tokens") or 0),
    )


def abort_payload(rid: str) -> Dict:
    """Body of ``POST /abort_request`` for one sample (SGLang's AbortReq)."""
    return {"rid": rid, "abort_all": False}


SYNC_TENSOR_PREFIX = "megarl_sync"


def sync_trigger_name(version: int, replica: int) -> str:
    return f"{SYNC_TENSOR_PREFIX}/{int(version)}/{int(replica)}"


def parse_sync_trigger_name(name: str) -> Tuple[int, int]:
    """(version, replica) from the trigger's tensor name; names the fault otherwise."""
    parts = name.split("/")
    if len(parts) != 3 or parts[0] != SYNC_TENSOR_PREFIX:
        raise MegarlError(
            f"megarl's weight loader got tensor {name!r}; expected '{SYNC_TENSOR_PREFIX}/<version>/<replica>'"
        )
    return int(parts[1]), int(parts[2])


def sync_trigger_payload(version: int, replica: int, tp: int, loader: str) -> Dict:
    """``/update_weights_from_tensor`` body that runs megarl's receiver in every TP worker.

    SGLang deserialises ``serialized_named_tensors[tp_rank]`` in each TP
    worker (its MultiprocessingSerializer: ForkingPickler bytes, base64 in
    JSON) and hands the list to the custom loader named by ``load_format``.
    The one tensor is empty -- version and replica travel in its name -- so
    the payload carries no shared memory or file descriptor: it deserialises
    on any host, and passes SGLang's SafeUnpickler allow-list (an empty
    storage rebuilds through ``rebuild_storage_empty``).
    """
    buf = io.BytesIO()
    ForkingPickler(buf).dump([(sync_trigger_name(version, replica), torch.empty(0, dtype=torch.int64))])
    blob = base64.b64encode(buf.getvalue()).decode()
    return {
        "serialized_named_tensors": [blob] * tp,
        "load_format": loader,
        "flush_cache": False,
        "abort_all_requests": False,
        "weight_version": str(version),
    }


def update_version_payload(version: int) -> Dict:
    # abort_all_requests defaults to True in SGLang: it would abort every paused request
    return {"new_version": str(version), "abort_all_requests": False}


def check_ok(answer: Dict, server: str, endpoint: str) -> None:
    """Control endpoints answer {"success": bool, "message": str}; some answer nothing.
    ``server``: how to name the server in the error (its URL, or replica and URL)."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SglangResponseError(f"{server}: {endpoint} failed: {answer.get('message', '')}")
