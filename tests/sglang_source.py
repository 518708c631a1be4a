"""SGLang 0.5.23's own definitions, read from its installed source (SGLang does not import on CPU).

``make setup`` installs ``sglang==0.5.23 --no-deps``: its files are here, its
dependencies (triton, zmq, CUDA kernels) are not. These helpers read what the
CPU tests and the protocol test server need straight from those files with
``ast``: request field names, server-argument names, the unpickling
allow-list, and SGLang's weight-version-span functions (executed).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Set

SGLANG_VERSION = "0.5.23"


class SglangSourceMissing(RuntimeError):
    pass


def sglang_file(rel: str) -> Path:
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise SglangSourceMissing(
            "sglang source not installed (make setup installs sglang==0.5.23 --no-deps)"
        ) from None
    return Path(dist.locate_file(f"sglang/srt/{rel}"))


@lru_cache(maxsize=None)
def tree(rel: str) -> ast.Module:
    return ast.parse(sglang_file(rel).read_text())


def _classes(module: ast.Module) -> Dict[str, ast.ClassDef]:
    return {n.name: n for n in module.body if isinstance(n, ast.ClassDef)}


def class_fields(rel: str, name: str) -> Dict[str, str]:
    """Annotated fields of class ``name`` in SGLang file ``rel``, with those of its bases in the
    same file (e.g. BaseReq's ``rid``): field -> annotation source."""
    classes = _classes(tree(rel))
    if name not in classes:
        raise AssertionError(f"SGLang's {rel} has no class {name}")
    out: Dict[str, str] = {}
    for base in classes[name].bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(class_fields(rel, base.id))
    for s in classes[name].body:
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            out[s.target.id] = ast.unparse(s.annotation)
    return out


@lru_cache(maxsize=None)
def server_arg_fields() -> Set[str]:
    """Every ``ServerArgs`` field (the ``--flag-name`` of launch_server is ``flag_name``)."""
    names: Set[str] = set()
    for path in sorted(sglang_file("arg_groups/fields").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names |= {
                    s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
    return names


@lru_cache(maxsize=None)
def safe_unpickler_globals() -> Set[tuple]:
    """SafeUnpickler.ALLOWED_GLOBALS: what SGLang's MultiprocessingSerializer will rebuild."""
    cls = _classes(tree("utils/common.py"))["SafeUnpickler"]
    for s in cls.body:
        if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ALLOWED_GLOBALS" for t in s.targets):
            return set(ast.literal_eval(s.value))
    raise AssertionError("SGLang's SafeUnpickler has no ALLOWED_GLOBALS")


def http_routes() -> Set[str]:
    routes = set()
    for node in ast.walk(tree("entrypoints/http_server.py")):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and dec.args and isinstance(dec.args[0], ast.Constant):
                    routes.add(dec.args[0].value)
    return routes


def span_functions() -> Dict[str, Any]:
    """SGLang's own span bookkeeping (utils/weight_versions.py), executed with plain stand-ins."""
    module = tree("utils/weight_versions.py")
    wanted = {"record_weight_version_events", "compute_weight_version_spans", "add_weight_versions_to_meta_info"}
    funcs = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert len(funcs) == 3, [f.name for f in funcs]

    @dataclasses.dataclass
    class WeightVersionSpan:
        version: str
        start: int
        end: int

    @dataclasses.dataclass(frozen=True)
    class WeightVersionEvent:
        old_version: str
        num_output_tokens: int

    ns: Dict[str, Any] = {
        "WeightVersionSpan": WeightVersionSpan,
        "WeightVersionEvent": WeightVersionEvent,
        "WeightVersionSpans": List,
        "List": List,
        "Dict": Dict,
        "Any": Any,
        "Iterable": List,
        "Req": object,
        "annotations": None,
    }
    exec(compile(ast.Module(body=funcs, type_ignores=[]), "weight_versions.py", "exec"), ns)
    return ns
