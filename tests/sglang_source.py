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
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

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


HTTP_SERVER = "sglang.srt.entrypoints.http_server"
# FastAPI's own parameter types: never the request body
_FRAMEWORK_TYPES = {"Request", "Response", "WebSocket", "str", "int", "float", "bool"}
_NOT_BODY = {"Query", "Form", "File", "Path", "Header", "Depends"}


@dataclasses.dataclass(frozen=True)
class Route:
    """One route of SGLang's http_server: its HTTP methods and the class its JSON body is parsed
    into (``(module, class name)``; None for a route without a body, such as ``/health``)."""

    path: str
    methods: FrozenSet[str]
    body: Optional[Tuple[str, str]]
    handler: str


def _route_path(arg: ast.expr) -> Optional[str]:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    # @app.post(os.environ.get("SGLANG_OLLAMA_CHAT_ROUTE", "/api/chat")): the default path
    if isinstance(arg, ast.Call) and len(arg.args) == 2 and isinstance(arg.args[1], ast.Constant):
        return arg.args[1].value
    return None


def _route_methods(dec: ast.Call) -> FrozenSet[str]:
    verb = dec.func.attr
    if verb != "api_route":
        return frozenset({verb.upper()})
    for kw in dec.keywords:
        if kw.arg == "methods":
            return frozenset(ast.literal_eval(kw.value))
    return frozenset({"GET"})  # FastAPI's default for api_route


def _body_class_name(fn) -> Optional[str]:
    """The class FastAPI parses the body into: a parameter annotated ``X``, ``Annotated[X, Body()]``
    or ``Annotated[Optional[X], Body()]``; else a ``X(**(await request.json()))`` in the body."""
    args = fn.args.args + fn.args.kwonlyargs
    defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults + fn.args.kw_defaults
    for arg, default in zip(args, defaults):
        if isinstance(default, ast.Call) and _name(default.func) in _NOT_BODY:
            continue  # a query, form or file parameter
        node = arg.annotation
        while isinstance(node, ast.Subscript) and _name(node.value) in ("Annotated", "Optional"):
            node = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
        if isinstance(node, ast.Name) and node.id not in _FRAMEWORK_TYPES:
            return node.id
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and any(kw.arg is None and isinstance(kw.value, ast.Await) for kw in node.keywords)
        ):
            return node.func.id
    return None


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


@lru_cache(maxsize=None)
def route_table() -> Dict[str, Route]:
    """Every route http_server.py serves -> its methods and body class, from the decorated handlers.

    Body classes are found where the handler's module gets them (its imports, or an import inside
    the handler), so each maps to the module that defines it (io_struct.py for the native routes)."""
    routes: Dict[str, Route] = {}
    for fn in ast.walk(module_tree(HTTP_SERVER)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = [
            d
            for d in fn.decorator_list
            if isinstance(d, ast.Call)
            and isinstance(d.func, ast.Attribute)
            and _name(d.func.value) == "app"
            and d.func.attr not in ("exception_handler", "middleware")
            and d.args
            and _route_path(d.args[0]) is not None
        ]
        if not decorators:
            continue
        cls = _body_class_name(fn)
        body = None
        if cls is not None:
            local = {
                a.asname or a.name: n.module for n in ast.walk(fn) if isinstance(n, ast.ImportFrom) for a in n.names
            }
            found = find_definition(local.get(cls, HTTP_SERVER), cls)
            if found is None or not isinstance(found[1], ast.ClassDef):
                raise AssertionError(f"http_server.py's {fn.name} parses its body into {cls}, which is not found")
            body = (found[0], cls)
        for dec in decorators:
            path = _route_path(dec.args[0])
            methods = _route_methods(dec)
            if path in routes:  # one path, several decorators (@app.get + @app.head)
                methods |= routes[path].methods
            routes[path] = Route(path, methods, body, fn.name)
    return routes


def http_routes() -> Set[str]:
    return set(route_table())


# -- definitions across SGLang's modules ------------------------------------------------------------


def module_file(module: str) -> Optional[Path]:
    """The source file of an ``sglang.*`` module (None for anything outside SGLang)."""
    if module != "sglang" and not module.startswith("sglang."):
        return None
    root = sglang_file("").parents[0]  # .../sglang
    path = root.joinpath(*module.split(".")[1:])
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def module_tree(module: str) -> ast.Module:
    path = module_file(module)
    if path is None:
        raise SglangSourceMissing(f"no source file for SGLang module {module}")
    return ast.parse(path.read_text())


def _runtime_statements(body: List[ast.stmt]):
    """Module-level statements as they run: ``if TYPE_CHECKING:`` takes its else branch."""
    for s in body:
        if isinstance(s, ast.If):
            test = s.test
            type_checking = _name(test) == "TYPE_CHECKING"
            yield from _runtime_statements(s.orelse if type_checking else s.body + s.orelse)
        elif isinstance(s, ast.Try):
            yield from _runtime_statements(s.body)
        else:
            yield s


@lru_cache(maxsize=None)
def find_definition(module: str, name: str, depth: int = 0) -> Optional[Tuple[str, ast.AST]]:
    """Where ``name`` is defined as seen from ``module``: (defining module, its ClassDef or the
    value of its module-level assignment), following ``from X import name`` within SGLang.
    None for a name from outside SGLang (typing, torch, pydantic ...)."""
    if depth > 8 or module_file(module) is None:
        return None
    imported, starred = None, []
    for s in _runtime_statements(module_tree(module).body):
        if isinstance(s, ast.ClassDef) and s.name == name:
            return module, s
        if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in s.targets):
            return module, s.value
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == name and s.value:
            return module, s.value
        if isinstance(s, ast.ImportFrom):
            source = s.module or ""
            if s.level:  # relative import
                base = module.split(".")
                is_package = module_file(module).name == "__init__.py"
                base = base[: len(base) - s.level + (1 if is_package else 0)]
                source = ".".join(base + ([s.module] if s.module else []))
            for a in s.names:
                if a.name == "*":
                    starred.append(source)
                elif (a.asname or a.name) == name and imported is None:
                    imported = (source, a.name)
    if imported is not None:
        return find_definition(imported[0], imported[1], depth + 1)
    for source in starred:  # from sglang.srt.utils.common import *
        found = find_definition(source, name, depth + 1)
        if found is not None:
            return found
    return None


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
