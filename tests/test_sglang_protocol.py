"""The SGLang backend's requests and response parsing, against SGLang's own source.

SGLang does not import on a CPU machine (triton, zmq, CUDA kernels), so these
tests read SGLang 0.5.23's own files from its installed distribution
(``make setup`` installs it with --no-deps): request field names from
io_struct.py / sampling_params.py via ``ast``, the routes from http_server.py,
and SGLang's own weight-version-span functions, executed here, to build the
meta_info our parser reads.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any, Dict

import pytest

from megarl.errors import MegarlError
from megarl.generator.interface import ABORTED, GenerationRequest, SamplingParams
from megarl.generator.sglang import protocol, serving
from tests import sglang_source


@pytest.fixture(autouse=True)
def _needs_sglang_source():
    try:
        sglang_source.sglang_file("managers/io_struct.py")
    except sglang_source.SglangSourceMissing as e:
        pytest.skip(str(e))


def _fields(name: str, rel: str = "managers/io_struct.py") -> Dict[str, str]:
    return sglang_source.class_fields(rel, name)


REQUEST = GenerationRequest(
    "q7",
    [5, 6, 7],
    SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=9, stop_token_ids=(2,), seed=11),
    n=2,
    group_id=3,
    meta={"answer": "4"},
)


def test_generate_request_uses_sglang_field_names():
    payload = protocol.generate_payload(REQUEST, 1)
    fields = _fields("GenerateReqInput")
    assert set(payload) <= set(fields), set(payload) - set(fields)
    sp_fields = _fields("SamplingParams", "sampling/sampling_params.py")
    assert set(payload["sampling_params"]) <= set(sp_fields), set(payload["sampling_params"]) - set(sp_fields)
    assert payload["rid"] == "q7#1" and payload["sampling_params"]["sampling_seed"] == 12
    assert payload["sampling_params"]["top_k"] == -1  # SGLang's "all tokens"


def test_control_requests_use_sglang_field_names():
    pause = _fields("PauseGenerationReqInput")
    assert set(protocol.PAUSE_IN_PLACE) <= set(pause) and "in_place" in pause["mode"]
    version = protocol.update_version_payload(4)
    assert set(version) <= set(_fields("UpdateWeightVersionReqInput"))
    assert version == {"new_version": "4", "abort_all_requests": False}
    dist = protocol.distributed_update(["model.norm.weight"], ["bfloat16"], [[64]], 4)
    assert set(dist) <= set(_fields("UpdateWeightsFromDistributedReqInput"))
    assert dist["flush_cache"] is False and dist["load_format"] == "flattened_bucket"
    abort = protocol.abort_payload("g7#1")
    assert set(abort) <= set(_fields("AbortReq")) and abort == {"rid": "g7#1", "abort_all": False}
    trigger = protocol.sync_trigger_payload(5, 2, tp=3, loader=serving.WORKER_LOADER)
    assert set(trigger) <= set(_fields("UpdateWeightsFromTensorReqInput"))
    assert len(trigger["serialized_named_tensors"]) == 3 and trigger["weight_version"] == "5"


def test_sync_trigger_deserialises_under_sglangs_safe_unpickler():
    """The trigger passes SGLang's allow-list and carries no shared memory (any host can read it)."""
    import pickle

    allowed = sglang_source.safe_unpickler_globals()
    seen = []

    class SafeUnpickler(pickle.Unpickler):  # SGLang's find_class rule, with its own allow-list
        def find_class(self, module, name):
            seen.append((module, name))
            if (module, name) not in allowed:
                raise RuntimeError(f"Blocked unsafe global ({module}.{name})")
            return super().find_class(module, name)

    blob = protocol.sync_trigger_payload(7, 1, tp=2, loader="x.y")["serialized_named_tensors"][1]
    ((name, tensor),) = SafeUnpickler(io.BytesIO(base64.b64decode(blob))).load()
    assert protocol.parse_sync_trigger_name(name) == (7, 1) and tensor.numel() == 0
    assert ("torch.multiprocessing.reductions", "rebuild_storage_empty") in seen
    assert not {m for m in seen if m[1] in ("rebuild_storage_fd", "rebuild_storage_filename")}
    with pytest.raises(MegarlError, match="expected 'megarl_sync/<version>/<replica>'"):
        protocol.parse_sync_trigger_name("model.norm.weight")


def test_launch_arguments_are_sglang_server_args():
    fields = sglang_source.server_arg_fields()
    args = serving.server_args("/m", 30001, tp=8, base_gpu_id=8, mem_fraction=0.8)
    flags = [a[2:].replace("-", "_") for a in args if a.startswith("--")]
    assert flags and set(flags) <= fields, set(flags) - fields
    assert args[args.index("--custom-weight-loader") + 1] == serving.WORKER_LOADER
    assert args[args.index("--base-gpu-id") + 1] == "8" and args[args.index("--tp-size") + 1] == "8"


def test_every_endpoint_megarl_calls_is_an_sglang_route():
    used = {
        "/generate",
        "/pause_generation",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/update_weight_version",
        "/continue_generation",
        "/abort_request",
        "/health",
    }
    assert used <= sglang_source.http_routes(), used - sglang_source.http_routes()


def test_block_fp8_scales_are_renamed_by_sglangs_loader():
    """Why fp8 goes through megarl's receiver: SGLang's Llama loader renames the scale and drops it."""
    src = sglang_source.sglang_file("models/llama.py").read_text()
    assert 'name.replace(".weight_scale_inv", ".weight_scale")' in src
    with pytest.raises(MegarlError, match="weight_scale_inv"):
        protocol.distributed_update(["model.layers.0.mlp.down_proj.weight_scale_inv"], ["float32"], [[1, 1]], 1)
    assert serving.block_fp8_hf_config({"a": 1})["quantization_config"]["weight_block_size"] == [128, 128]


def _sglang_answer(output_ids, logprobs, meta_extra, finish="length"):
    return {
        "text": "",
        "output_ids": output_ids,
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": finish, "length": len(output_ids)},
            "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, output_ids)],
            **meta_extra,
        },
    }


def test_version_spans_from_sglangs_own_bookkeeping():
    ns = sglang_source.span_functions()

    class Req:  # what record_weight_version_events reads and writes
        def __init__(self):
            self.output_ids, self.weight_version_events = [], []

    req = Req()
    req.output_ids = [10, 11, 12, 13, 14]  # five tokens under version "0"
    ns["record_weight_version_events"]([req], "0")  # update 0 -> 3 between decode steps
    req.output_ids += [15, 16, 17]
    spans = ns["compute_weight_version_spans"](req.weight_version_events, "3", len(req.output_ids))
    meta: Dict[str, Any] = {}
    ns["add_weight_versions_to_meta_info"](meta, spans, len(req.output_ids))
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 5}, {"version": "3", "start": 5, "end": 8}]

    logprobs = [-0.1 * (i + 1) for i in range(8)]
    c = protocol.parse_generate_output(_sglang_answer(req.output_ids, logprobs, meta), REQUEST, 1)
    assert c.versions == [0] * 5 + [3] * 3 and c.version_spans() == [(0, 0, 5), (3, 5, 8)]
    assert c.logprobs == logprobs and c.output_ids == req.output_ids and c.finish_reason == "length"
    assert (c.request_id, c.sample_index, c.group_id, c.meta) == ("q7", 1, 3, {"answer": "4"})
    sample = c.to_sample(reward=1.0)
    assert sample.policy_versions == c.versions and math.isclose(sample.behaviour_logprobs[-1], -0.8)


def test_parser_names_the_fault():
    meta = {"weight_version": "2"}
    ok = protocol.parse_generate_output(_sglang_answer([4, 2], [-1.0, -0.5], meta, "stop"), REQUEST, 0, "http://g0")
    assert ok.versions == [2, 2] and ok.finish_reason == "stop"
    no_logprobs = {"output_ids": [4], "meta_info": {"finish_reason": {"type": "stop"}}}
    with pytest.raises(MegarlError, match=r"http://g0, request q7#0: output_token_logprobs .*return_logprob"):
        protocol.parse_generate_output(no_logprobs, REQUEST, 0, "http://g0")
    aborted = protocol.parse_generate_output(_sglang_answer([4], [-1.0], meta, "abort"), REQUEST, 0, "http://g0")
    assert aborted.finish_reason == ABORTED  # the backend checks that megarl asked for it
    with pytest.raises(MegarlError, match="not a megarl policy version"):
        protocol.parse_generate_output(_sglang_answer([4], [-1.0], {"weight_version": "default"}), REQUEST, 0)
