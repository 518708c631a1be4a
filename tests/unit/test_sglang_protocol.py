"""The SGLang backend's requests and response parsing, against SGLang's own source.

SGLang does not import on a CPU machine (triton, zmq, CUDA kernels), so these
tests read SGLang 0.5.23's own files from its installed distribution
(``make setup`` installs it with --no-deps): the routes and the class each
parses its body into from http_server.py, those classes' fields, types and
defaults from io_struct.py / sampling_params.py (tests/sglang_contract.py),
and SGLang's own weight-version-span functions, executed here, to build the
meta_info our parser reads.
"""

from __future__ import annotations

import ast
import base64
import io
import math
from pathlib import Path
from typing import Any, Dict

import pytest

from megarl.errors import MegarlError
from megarl.generator.interface import ABORTED, GenerationRequest, SamplingParams
from megarl.generator.sglang import protocol, serving
from tests import sglang_contract, sglang_source

SGLANG_PACKAGE = Path(protocol.__file__).parent


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


def test_generate_request_is_one_sglangs_classes_accept():
    payload = protocol.generate_payload(REQUEST, 1)
    sglang_contract.check_request("/generate", "POST", payload)  # GenerateReqInput: keys, types
    sglang_contract.check_sampling_params(payload["sampling_params"])  # SamplingParams(**sampling_params)
    assert payload["rid"] == "q7#1" and payload["sampling_params"]["sampling_seed"] == 12
    assert payload["sampling_params"]["top_k"] == -1  # SGLang's "all tokens"
    greedy = GenerationRequest("g", [1], SamplingParams(temperature=0.0, top_k=5, max_new_tokens=2, seed=None))
    sglang_contract.check_sampling_params(protocol.generate_payload(greedy, 0)["sampling_params"])


def test_control_requests_are_ones_sglangs_classes_accept():
    bodies = {
        "/pause_generation": protocol.PAUSE_IN_PLACE,
        "/begin_weight_update": {},
        "/update_weights_from_tensor": protocol.sync_trigger_payload(5, 2, tp=3, loader=serving.WORKER_LOADER),
        "/end_weight_update": {},
        "/update_weight_version": protocol.update_version_payload(4),
        "/continue_generation": {},
        "/abort_request": protocol.abort_payload("g7#1"),
    }
    for route, body in bodies.items():
        sglang_contract.check_request(route, "POST", body)
    assert bodies["/update_weight_version"] == {"new_version": "4", "abort_all_requests": False}
    assert bodies["/abort_request"] == {"rid": "g7#1", "abort_all": False}
    trigger = bodies["/update_weights_from_tensor"]
    assert len(trigger["serialized_named_tensors"]) == 3 and trigger["weight_version"] == "5"
    assert trigger["flush_cache"] is False and trigger["abort_all_requests"] is False


def test_the_checker_refuses_what_sglangs_classes_refuse():
    """Each refusal names the field: a wrong type, a missing required field, an unknown key, a value
    outside a Literal, bytes that are not base64 -- so the checks above can fail."""
    good = protocol.generate_payload(REQUEST, 0)
    refused = {
        ("/generate", "rid"): dict(good, rid=7),
        ("/generate", "input_ids[1]"): dict(good, input_ids=[5, "6"]),
        ("/generate", "return_logprob"): dict(good, return_logprob=1),
        ("/generate", "['max_tokens']"): dict(good, max_tokens=9),
        ("/update_weight_version", "['new_version']"): {"abort_all_requests": False},
        ("/update_weight_version", "new_version"): {"new_version": 4},
        ("/pause_generation", "'inplace' is not one of SGLang's values ['abort', 'retract', 'in_place']"): {
            "mode": "inplace"
        },
        ("/abort_request", "abort_all"): {"rid": "x", "abort_all": "no"},
        ("/update_weights_from_tensor", "serialized_named_tensors[0]"): {"serialized_named_tensors": ["not base64!"]},
        ("/update_weights_from_tensor", "['serialized_named_tensors']"): {"load_format": "x"},
    }
    for (route, named), body in refused.items():
        with pytest.raises(sglang_contract.ContractError, match=_literal(named)):
            sglang_contract.check_request(route, "POST", body)
    sp = good["sampling_params"]
    for named, bad in {"temperature": dict(sp, temperature="1"), "['seed']": dict(sp, seed=3)}.items():
        with pytest.raises(sglang_contract.ContractError, match=_literal(named)):
            sglang_contract.check_sampling_params(bad)
    with pytest.raises(sglang_contract.UnknownRoute):
        sglang_contract.check_request("/update_weights_from_tensors", "POST", {})
    with pytest.raises(sglang_contract.WrongMethod):
        sglang_contract.check_request("/abort_request", "GET", {})


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_route_table_is_read_from_http_server():
    table = sglang_source.route_table()
    io_struct = "sglang.srt.managers.io_struct"
    assert table["/generate"].body == (io_struct, "GenerateReqInput") and table["/generate"].methods == {"POST", "PUT"}
    assert table["/abort_request"].body == (io_struct, "AbortReq") and table["/abort_request"].methods == {"POST"}
    assert table["/pause_generation"].body == (io_struct, "PauseGenerationReqInput")
    assert table["/update_weights_from_tensor"].body == (io_struct, "UpdateWeightsFromTensorReqInput")
    assert table["/health"].body is None and table["/health"].methods == {"GET"}
    # every route with a body: its handler really names that class (read back from the handler's source)
    source = sglang_source.sglang_file("entrypoints/http_server.py").read_text()
    handlers = {
        n.name: ast.get_source_segment(source, n)
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    with_body = [r for r in table.values() if r.body is not None]
    assert len(with_body) > 40
    for r in with_body:
        assert r.body[1] in handlers[r.handler], r


def _routes_megarl_calls():
    """(method, route) of every call megarl's SGLang package makes: post / _control / get_ok with a
    literal route, found in its source."""
    calls = set()
    for path in sorted(SGLANG_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name not in ("post", "_control", "get_ok"):
                continue
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("/"):
                    calls.add(("GET" if name == "get_ok" else "POST", arg.value))
    return calls


def test_every_route_megarl_calls_is_served_by_sglang_for_its_method():
    calls = _routes_megarl_calls()
    assert {("POST", "/generate"), ("POST", "/abort_request"), ("GET", "/health")} <= calls, calls
    assert len(calls) == 9, calls  # generate, abort, the six update-protocol routes, health
    table = sglang_source.route_table()
    for method, route in calls:
        assert route in table and method in table[route].methods, (method, route)
        if table[route].body is not None:  # and SGLang's test server can check every field of its body
            for field in sglang_contract.route_fields(route).values():
                assert not sglang_contract.uninterpretable(field.annotation, field.module), (route, field)
    for field in sglang_contract.class_fields(*sglang_contract.SAMPLING_PARAMS).values():
        assert not sglang_contract.uninterpretable(field.annotation, field.module), field


def pause_modes_megarl_sends():
    """Every ``"mode"`` value of a dict literal in megarl's SGLang package (the pause bodies)."""
    modes = set()
    for path in sorted(SGLANG_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == "mode":
                        modes.add(ast.literal_eval(v))
    return modes


def test_every_pause_mode_megarl_sends_is_one_sglang_accepts():
    modes = pause_modes_megarl_sends()
    assert modes == {"in_place"}  # the only pause that keeps requests and their KV cache
    mode = sglang_contract.route_fields("/pause_generation")["mode"]
    for m in modes:
        sglang_contract.check_value(m, mode.annotation, mode.module, "mode")
    assert mode.default_value() == "abort"  # why megarl must always send it


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
    assert "--ep-size" not in args
    experts = serving.server_args("/m", 30001, tp=8, base_gpu_id=0, ep=4)
    flags = [a[2:].replace("-", "_") for a in experts if a.startswith("--")]
    assert "ep_size" in flags and set(flags) <= fields
    assert experts[experts.index("--ep-size") + 1] == "4"


def test_block_fp8_scales_are_renamed_by_sglangs_loader():
    """Why fp8 goes through megarl's receiver: SGLang's Llama loader renames the scale and drops it."""
    src = sglang_source.sglang_file("models/llama.py").read_text()
    assert 'name.replace(".weight_scale_inv", ".weight_scale")' in src
    assert serving.block_fp8_hf_config({"a": 1})["quantization_config"]["weight_block_size"] == [128, 128]


def test_fp8_expert_parameters_are_sglangs_fp8_moe_ones():
    """The block-fp8 expert tensors megarl's receiver writes are the ones SGLang's Fp8MoEMethod
    registers (by name, with one scale grid per expert), and the shard rule megarl refuses by is
    the one SGLang raises on."""
    from transformers import Qwen3MoeConfig

    from megarl.models.spec import ModelSpec
    from megarl.weight_sync.endpoints import allocate_generator_params

    src = sglang_source.sglang_file("layers/quantization/fp8.py").read_text()
    assert 'layer.register_parameter("w13_weight_scale_inv", w13_weight_scale)' in src
    assert 'layer.register_parameter("w2_weight_scale_inv", w2_weight_scale)' in src
    assert "* ((intermediate_size_per_partition + block_n - 1) // block_n)," in src  # w13: per shard, per expert
    assert "if intermediate_size_per_partition % block_n != 0:" in src
    config = Qwen3MoeConfig(
        vocab_size=300, hidden_size=256, head_dim=128, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=256, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
    )  # fmt: skip
    params = allocate_generator_params(ModelSpec.from_hf_config(config), 4, 1, fp8=True, ep=2)
    p = "model.layers.1.mlp.experts."
    # SGLang at --tp 4 --ep-size 2: 4 local experts, intermediate_size_per_partition 512 / 2 = 256
    assert params[p + "w13_weight"].shape == (4, 2 * 256, 256)
    assert params[p + "w13_weight_scale_inv"].shape == (4, 2 * ((256 + 127) // 128), (256 + 127) // 128)
    assert params[p + "w2_weight_scale_inv"].shape == (4, (256 + 127) // 128, (256 + 127) // 128)
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in params  # the router stays unquantised


def test_each_tp_worker_reads_its_own_entry_of_the_trigger():
    """SGLang's TP worker deserialises serialized_named_tensors[tp_rank] (tp_worker.py): the trigger
    has one entry per worker, and megarl's loader path is what SGLang imports and calls."""
    src = sglang_source.sglang_file("managers/tp_worker.py").read_text()
    assert "serialized_named_tensors[get_parallel().tp_rank]" in src
    updater = sglang_source.sglang_file("model_executor/model_runner_components/weight_updater.py").read_text()
    assert "custom_loader = dynamic_import(load_format)" in updater
    assert "custom_loader(self.get_model(), named_tensors)" in updater


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
    assert ok.versions == [2, 2] and ok.finish_reason == "stop" and ok.cached_tokens == 0
    cached = protocol.parse_generate_output(
        _sglang_answer([4, 2], [-1.0, -0.5], {**meta, "cached_tokens": 3}, "stop"), REQUEST, 0
    )
    assert cached.cached_tokens == 3  # the radix cache's hit, as the episode's prompt_cached metric reads it
    no_logprobs = {"output_ids": [4], "meta_info": {"finish_reason": {"type": "stop"}}}
    with pytest.raises(MegarlError, match=r"http://g0, request q7#0: output_token_logprobs .*return_logprob"):
        protocol.parse_generate_output(no_logprobs, REQUEST, 0, "http://g0")
    aborted = protocol.parse_generate_output(_sglang_answer([4], [-1.0], meta, "abort"), REQUEST, 0, "http://g0")
    assert aborted.finish_reason == ABORTED  # the backend checks that megarl asked for it
    with pytest.raises(MegarlError, match="not a megarl policy version"):
        protocol.parse_generate_output(_sglang_answer([4], [-1.0], {"weight_version": "default"}), REQUEST, 0)


# routing replay: SGLang's --enable-return-routed-experts and the request's return_routed_experts
LAYOUT = protocol.RoutedExpertsLayout(num_layers=3, top_k=2, num_experts=4, moe_layers=(1, 2))


def test_routed_experts_request_and_flag_are_sglangs():
    payload = protocol.generate_payload(REQUEST, 0, routed_experts=True)
    sglang_contract.check_request("/generate", "POST", payload)  # GenerateReqInput has both fields
    assert payload["return_routed_experts"] is True and payload["routed_experts_start_len"] == 0
    assert "return_routed_experts" not in protocol.generate_payload(REQUEST, 0)  # a host gather per request
    fields = sglang_source.server_arg_fields()
    args = serving.server_args("/m", 30001, tp=4, base_gpu_id=0, ep=2, routed_experts=True)
    flags = [a[2:].replace("-", "_") for a in args if a.startswith("--")]
    assert "enable_return_routed_experts" in flags and set(flags) <= fields, set(flags) - fields
    assert "--enable-return-routed-experts" not in serving.server_args("/m", 30001, tp=4, base_gpu_id=0, ep=2)
    # SGLang's answer covers [routed_experts_start_len, seqlen - 1) and is int32 base64 (what the parser assumes)
    io_struct = sglang_source.sglang_file("managers/io_struct.py").read_text()
    assert "`[routed_experts_start_len, seqlen - 1)`" in io_struct
    batch = sglang_source.sglang_file("managers/scheduler_components/batch_result_processor.py").read_text()
    assert "seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)" in batch
    tokenizer = sglang_source.sglang_file("managers/tokenizer_manager.py").read_text()
    assert 'pybase64.b64encode(val.numpy().tobytes()).decode("utf-8")' in tokenizer
    capturer = sglang_source.sglang_file("state_capturer/base.py").read_text()
    assert (
        "dtype=torch.int32" in capturer
        and "num_hidden_layers" in sglang_source.sglang_file("state_capturer/routed_experts.py").read_text()
    )


def _sglangs_decoder():
    """SGLang's own extract_routed_experts_from_meta_info, executed (numpy int32 from base64)."""
    import numpy as np

    module = sglang_source.tree("state_capturer/routed_experts.py")
    (func,) = [
        n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "extract_routed_experts_from_meta_info"
    ]
    ns = {"np": np, "pybase64": base64}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "routed_experts.py", "exec"), ns)
    return ns["extract_routed_experts_from_meta_info"]


def test_routed_experts_are_parsed_as_sglang_decodes_them():
    import torch

    g = torch.Generator().manual_seed(0)
    output = [4, 2, 9]
    positions = len(REQUEST.prompt_ids) + len(output) - 1  # 5: the last output token is never fed
    captured = torch.randint(0, 4, (positions, 3, 2), generator=g, dtype=torch.int32)
    captured[:, 0] = 0  # the dense layer: SGLang's zeroed buffer, never written
    meta = {"weight_version": "1", "routed_experts": base64.b64encode(captured.numpy().tobytes()).decode()}
    c = protocol.parse_generate_output(_sglang_answer(output, [-1.0] * 3, meta), REQUEST, 0, "http://g0", routes=LAYOUT)
    sglangs = torch.as_tensor(_sglangs_decoder()({"meta_info": meta}).copy()).view(positions, 3, 2)
    assert c.routed_experts.dtype == torch.int16 and tuple(c.routed_experts.shape) == (positions, 3, 2)
    assert torch.equal(c.routed_experts[:, 1:].int(), sglangs[:, 1:])
    assert (c.routed_experts[:, 0] == -1).all()  # megarl's mark for "no router here"
    assert c.to_sample().routed_experts is c.routed_experts
    # without routes asked, none parsed
    assert protocol.parse_generate_output(_sglang_answer(output, [-1.0] * 3, meta), REQUEST, 0).routed_experts is None


def test_routed_experts_faults_are_named():
    output = [4, 2]
    with pytest.raises(
        MegarlError, match=r"http://g0, request q7#0: .*no meta_info.routed_experts.*--enable-return-routed-experts"
    ):
        protocol.parse_generate_output(
            _sglang_answer(output, [-1.0] * 2, {"weight_version": "1"}), REQUEST, 0, "http://g0", routes=LAYOUT
        )
    short = base64.b64encode(bytes(4 * 3 * 3 * 2)).decode()  # 3 positions, the sample fed 4
    with pytest.raises(MegarlError, match="routed_experts has 72 bytes, not the 4 positions"):
        protocol.parse_generate_output(
            _sglang_answer(output, [-1.0] * 2, {"routed_experts": short}), REQUEST, 0, "http://g0", routes=LAYOUT
        )
    import torch

    wrong = torch.full((4, 3, 2), 7, dtype=torch.int32)  # expert 7 of a 4-expert model
    with pytest.raises(MegarlError, match=r"outside \[0, 4\)"):
        protocol.parse_generate_output(
            _sglang_answer(output, [-1.0] * 2, {"routed_experts": base64.b64encode(wrong.numpy().tobytes()).decode()}),
            REQUEST,
            0,
            routes=LAYOUT,
        )
    # an abort megarl asked for carries no routes and is never trained: not an error
    aborted = protocol.parse_generate_output(_sglang_answer(output, [-1.0] * 2, {}, "abort"), REQUEST, 0, routes=LAYOUT)
    assert aborted.finish_reason == ABORTED and aborted.routed_experts is None


def test_sync_config_gives_the_workers_the_settings_the_trainer_ranks_hold(tmp_path):
    """The trainer ranks send with one SyncSettings; SGLang's workers rebuild theirs from the JSON
    the job writes. Every field must survive: a receiver with another bucket size, pack threshold,
    wire dtype or layout plans other rounds and the sync hangs or lands the wrong bytes."""
    import torch

    from megarl.models.presets import preset_spec
    from megarl.parallel_dims import GeneratorDims, ParallelDims
    from megarl.weight_sync.settings import SyncGeometry, SyncRendezvous, SyncSettings, WireFormat

    geometry = SyncGeometry(
        preset_spec("tiny"), ParallelDims(tp=2, pp=2, dp=1), GeneratorDims(tp=2, replicas=3), "te", 64
    )
    wire = WireFormat(fp8=True, dtype=torch.float32, bucket_bytes=12345, verify=True, pack_below_bytes=777)
    settings, rendezvous = SyncSettings(geometry, wire), SyncRendezvous("10.0.0.7", 29517, "nccl", 1234.0, "g")
    path = serving.write_sync_config(tmp_path / "sync_config.json", settings, rendezvous)
    assert serving.read_sync_config(path) == (settings, rendezvous)
    # each field is read back, not defaulted: a settings object differing in any one is told apart
    for other in (
        SyncSettings(geometry, WireFormat(fp8=True, dtype=torch.float32, verify=True, pack_below_bytes=777)),
        SyncSettings(SyncGeometry(geometry.spec, geometry.trainer, geometry.generator), wire),
    ):
        serving.write_sync_config(path, other, rendezvous)
        assert serving.read_sync_config(path) != (settings, rendezvous)
    with pytest.raises(ValueError, match="wire dtype 'fp16'"):
        WireFormat.named("fp16")
