"""The SGLang backend's requests and response parsing, against SGLang's own source.

SGLang does not import on a CPU machine (triton, zmq, CUDA kernels), so these
tests read SGLang 0.5.23's own files from its installed distribution
(``make setup`` installs it with --no-deps): request field names from
io_struct.py / sampling_params.py via ``ast``, the routes from http_server.py,
and SGLang's own weight-version-span functions, executed here, to build the
meta_info our parser reads.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import math
from pathlib import Path
from typing import Any, Dict, List

import pytest

from megarl.errors import MegarlError
from megarl.generator.interface import GenerationRequest, SamplingParams
from megarl.generator.sglang import protocol, serving


def _sglang_file(rel: str) -> Path:
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang source not installed (make setup installs sglang==0.5.23 --no-deps)")
    return Path(dist.locate_file(f"sglang/srt/{rel}"))


def _tree(rel: str) -> ast.Module:
    return ast.parse(_sglang_file(rel).read_text())


def _class_fields(tree: ast.Module, name: str) -> Dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {s.target.id: ast.unparse(s.annotation) for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    raise AssertionError(f"SGLang has no class {name}")


REQUEST = GenerationRequest("q7", [5, 6, 7], SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=9,
                                                             stop_token_ids=(2,), seed=11), n=2, group_id=3,
                            meta={"answer": "4"})


def test_generate_request_uses_sglang_field_names():
    io = _tree("managers/io_struct.py")
    payload = protocol.generate_payload(REQUEST, 1)
    fields = _class_fields(io, "GenerateReqInput")
    assert set(payload) <= set(fields), set(payload) - set(fields)
    sp_fields = _class_fields(_tree("sampling/sampling_params.py"), "SamplingParams")
    assert set(payload["sampling_params"]) <= set(sp_fields), set(payload["sampling_params"]) - set(sp_fields)
    assert payload["rid"] == "q7#1" and payload["sampling_params"]["sampling_seed"] == 12
    assert payload["sampling_params"]["top_k"] == -1  # SGLang's "all tokens"


def test_control_requests_use_sglang_field_names():
    io = _tree("managers/io_struct.py")
    pause = _class_fields(io, "PauseGenerationReqInput")
    assert set(protocol.PAUSE_IN_PLACE) <= set(pause) and "in_place" in pause["mode"]
    version = protocol.update_version_payload(4)
    assert set(version) <= set(_class_fields(io, "UpdateWeightVersionReqInput"))
    assert version == {"new_version": "4", "abort_all_requests": False}
    dist = protocol.distributed_update(["model.norm.weight"], ["bfloat16"], [[64]], 4)
    assert set(dist) <= set(_class_fields(io, "UpdateWeightsFromDistributedReqInput"))
    assert dist["flush_cache"] is False and dist["load_format"] == "flattened_bucket"
    # the trigger of megarl's in-worker receiver (built on GPU machines with SGLang's serializer)
    trigger_keys = {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version"}
    assert trigger_keys <= set(_class_fields(io, "UpdateWeightsFromTensorReqInput"))


def test_every_endpoint_megarl_calls_is_an_sglang_route():
    routes = set()
    for node in ast.walk(_tree("entrypoints/http_server.py")):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and dec.args and isinstance(dec.args[0], ast.Constant):
                    routes.add(dec.args[0].value)
    used = {"/generate", "/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
            "/update_weights_from_distributed", "/end_weight_update", "/update_weight_version",
            "/continue_generation"}
    assert used <= routes, used - routes


def test_block_fp8_scales_are_renamed_by_sglangs_loader():
    """Why fp8 goes through megarl's receiver: SGLang's Llama loader renames the scale and drops it."""
    src = _sglang_file("models/llama.py").read_text()
    assert 'name.replace(".weight_scale_inv", ".weight_scale")' in src
    with pytest.raises(MegarlError, match="weight_scale_inv"):
        protocol.distributed_update(["model.layers.0.mlp.down_proj.weight_scale_inv"], ["float32"], [[1, 1]], 1)
    assert serving.block_fp8_hf_config({"a": 1})["quantization_config"]["weight_block_size"] == [128, 128]


def _sglang_span_functions():
    """SGLang's own span bookkeeping (utils/weight_versions.py), executed with plain stand-ins."""
    tree = _tree("utils/weight_versions.py")
    wanted = {"record_weight_version_events", "compute_weight_version_spans", "add_weight_versions_to_meta_info"}
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert len(funcs) == 3

    @dataclasses.dataclass
    class WeightVersionSpan:
        version: str
        start: int
        end: int

    @dataclasses.dataclass(frozen=True)
    class WeightVersionEvent:
        old_version: str
        num_output_tokens: int

    ns: Dict[str, Any] = {"WeightVersionSpan": WeightVersionSpan, "WeightVersionEvent": WeightVersionEvent,
                          "WeightVersionSpans": List, "List": List, "Dict": Dict, "Any": Any,
                          "Iterable": List, "Req": object, "annotations": None}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), "weight_versions.py", "exec"), ns)
    return ns


def _sglang_answer(output_ids, logprobs, meta_extra, finish="length"):
    return {"text": "", "output_ids": output_ids,
            "meta_info": {"id": "x", "finish_reason": {"type": finish, "length": len(output_ids)},
                          "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, output_ids)],
                          **meta_extra}}


def test_version_spans_from_sglangs_own_bookkeeping():
    ns = _sglang_span_functions()

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
    with pytest.raises(MegarlError, match="aborted"):
        protocol.parse_generate_output(_sglang_answer([4], [-1.0], meta, "abort"), REQUEST, 0, "http://g0")
    with pytest.raises(MegarlError, match="not a megarl policy version"):
        protocol.parse_generate_output(_sglang_answer([4], [-1.0], {"weight_version": "default"}), REQUEST, 0)
