"""Checks a JSON request body against the SGLang class its route parses it into, from SGLang's source.

SGLang does not import on a CPU machine, so its request classes (io_struct.py's
dataclasses and msgspec Structs, sampling_params.py's SamplingParams) are read
with ``ast`` (tests/sglang_source.py) and their annotations are interpreted
here: ``Optional`` / ``Union`` / ``X | Y``, ``List`` / ``Set`` / ``Sequence`` /
``Tuple``, ``Dict``, ``Literal``, ``Annotated`` (SGLang's ``Base64Bytes``
marker: base64 text in JSON), ``Any``, the JSON scalars, SGLang's own type
aliases, enums and nested classes, wherever in SGLang they are defined.

A body passes when it names only the class's fields, gives every field without
a default, and each value has the field's type -- as JSON has it: an integer
where a float is declared passes, a string where an integer is declared does
not (stricter than pydantic's lax mode, which would coerce "4"). A name the
checker cannot interpret fails the request that uses that field, naming it:
nothing is let through unchecked.
"""

from __future__ import annotations

import ast
import base64
import binascii
import dataclasses
import json
from functools import lru_cache
from typing import Dict, List, Optional

from tests import sglang_source


class ContractError(ValueError):
    """A request body SGLang's class for the route would refuse (or that this checker cannot check)."""


class UnknownRoute(ContractError):
    """A path SGLang's http_server does not serve (FastAPI: 404)."""


class WrongMethod(ContractError):
    """A path SGLang serves, but not for this HTTP method (FastAPI: 405)."""


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    annotation: ast.expr
    module: str  # where the annotation is written: its names resolve there
    required: bool
    default: Optional[ast.expr] = None  # the default's source, when it has one

    def default_value(self):
        return ast.literal_eval(self.default)


_SEQUENCES = {"List", "list", "Sequence", "Set", "set", "FrozenSet", "frozenset", "Iterable"}
_MAPPINGS = {"Dict", "dict", "Mapping"}
_ENUM_BASES = {"Enum", "IntEnum", "StrEnum"}


def _has_default(value: Optional[ast.expr]) -> bool:
    """``x: T`` has none; ``x: T = v`` has one; so do ``field(default=...)`` / ``default_factory``."""
    if value is None:
        return False
    if isinstance(value, ast.Call) and sglang_source._name(value.func) == "field":
        return any(kw.arg in ("default", "default_factory") for kw in value.keywords)
    return True


@lru_cache(maxsize=None)
def class_fields(module: str, name: str) -> Dict[str, Field]:
    """The fields of class ``name`` as seen from ``module``, its SGLang bases' first."""
    found = sglang_source.find_definition(module, name)
    if found is None or not isinstance(found[1], ast.ClassDef):
        raise ContractError(f"{name} is not a class defined in SGLang (seen from {module})")
    where, cls = found
    out: Dict[str, Field] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name):
            defined = sglang_source.find_definition(where, base.id)
            if defined is not None and isinstance(defined[1], ast.ClassDef):
                out.update(class_fields(where, base.id))
    for s in cls.body:
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            if "ClassVar" in ast.unparse(s.annotation):
                continue
            required = not _has_default(s.value)
            out[s.target.id] = Field(s.target.id, s.annotation, where, required, None if required else s.value)
    return out


def _enum_values(cls: ast.ClassDef) -> Optional[List[object]]:
    if not any(sglang_source._name(b) in _ENUM_BASES for b in cls.bases):
        return None
    values = []
    for s in cls.body:
        if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant):
            values.append(s.value.value)
    return values


def _json_type(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _same(a, b) -> bool:
    """Literal membership as JSON means it: True is not 1."""
    return type(a) is type(b) and a == b


def _args(node: ast.Subscript) -> List[ast.expr]:
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


def check_value(value, node: ast.expr, module: str, where: str, base64_bytes: bool = False) -> None:
    """Raise ContractError naming ``where`` unless ``value`` (parsed JSON) has the type ``node``."""
    expected = ast.unparse(node)

    def fail(why: str = ""):
        raise ContractError(f"{where}: expected {expected}, got {_json_type(value)} {json.dumps(value)[:60]}{why}")

    if isinstance(node, ast.Constant):
        if node.value is None:
            return None if value is None else fail()
        if isinstance(node.value, str):  # a forward reference written as a string
            return check_value(value, ast.parse(node.value, mode="eval").body, module, where, base64_bytes)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _check_union(value, [node.left, node.right], module, where, base64_bytes, fail)
    if isinstance(node, ast.Subscript):
        head = sglang_source._name(node.value)
        args = _args(node)
        if head == "Optional":
            return None if value is None else check_value(value, args[0], module, where, base64_bytes)
        if head == "Union":
            return _check_union(value, args, module, where, base64_bytes, fail)
        if head == "Annotated":
            # SGLang's Base64Bytes marker: the HTTP body carries bytes as base64 text
            marked = any(isinstance(m, ast.Call) and sglang_source._name(m.func) == "Base64Bytes" for m in args[1:])
            return check_value(value, args[0], module, where, base64_bytes or marked)
        if head == "Literal":
            allowed = [ast.literal_eval(a) for a in args]
            if not any(_same(value, a) for a in allowed):
                raise ContractError(f"{where}: {value!r} is not one of SGLang's values {allowed}")
            return None
        if head in _SEQUENCES or head in ("Tuple", "tuple"):
            if not isinstance(value, list):
                fail()
            if head in ("Tuple", "tuple") and not (len(args) == 2 and isinstance(args[1], ast.Constant)):
                if len(value) != len(args):
                    fail(f" ({len(value)} items for {len(args)})")
                for i, (item, arg) in enumerate(zip(value, args)):
                    check_value(item, arg, module, f"{where}[{i}]", base64_bytes)
                return None
            for i, item in enumerate(value):
                check_value(item, args[0], module, f"{where}[{i}]", base64_bytes)
            return None
        if head in _MAPPINGS:
            if not isinstance(value, dict):
                fail()
            for key, item in value.items():
                check_value(item, args[1], module, f"{where}[{key!r}]", base64_bytes)
            return None
        raise ContractError(f"{where}: the checker does not know the type {expected}")
    name = sglang_source._name(node)
    if name in ("Any", "object"):
        return None
    if name == "str":
        return None if isinstance(value, str) else fail()
    if name == "bool":
        return None if isinstance(value, bool) else fail()
    if name == "int":
        return None if isinstance(value, int) and not isinstance(value, bool) else fail()
    if name == "float":
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else fail()
    if name == "bytes":
        if not isinstance(value, str):
            fail()
        if base64_bytes:
            try:
                base64.b64decode(value, validate=True)
            except binascii.Error:
                fail(" (not base64)")
        return None
    if name in _SEQUENCES or name in ("Tuple", "tuple"):
        return None if isinstance(value, list) else fail()
    if name in _MAPPINGS:
        return None if isinstance(value, dict) else fail()
    found = sglang_source.find_definition(module, name) if isinstance(node, ast.Name) else None
    if found is None:
        raise ContractError(f"{where}: the checker cannot interpret {expected} (not found in SGLang's source)")
    defined_in, definition = found
    if not isinstance(definition, ast.ClassDef):  # a type alias
        return check_value(value, definition, defined_in, where, base64_bytes)
    values = _enum_values(definition)
    if values is not None:
        if not any(_same(value, v) for v in values):
            raise ContractError(f"{where}: {value!r} is not a value of SGLang's {name} {values}")
        return None
    if not isinstance(value, dict):
        fail()
    return check_object(value, class_fields(defined_in, name), f"{where} ({name})")


def _check_union(value, options, module, where, base64_bytes, fail) -> None:
    errors = []
    for option in options:
        try:
            return check_value(value, option, module, where, base64_bytes)
        except ContractError as e:
            errors.append(str(e))
    fail(f" ({'; '.join(errors)})" if len(errors) > 1 else "")


def check_object(body, fields: Dict[str, Field], where: str) -> None:
    if not isinstance(body, dict):
        raise ContractError(f"{where}: the body must be a JSON object, got {_json_type(body)}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ContractError(f"{where}: fields {unknown} are not fields of SGLang's class")
    missing = sorted(f.name for f in fields.values() if f.required and f.name not in body)
    if missing:
        raise ContractError(f"{where}: required fields {missing} are missing (no default in SGLang's class)")
    for key, value in body.items():
        check_value(value, fields[key].annotation, fields[key].module, f"{where}.{key}")


def route_fields(route: str) -> Dict[str, Field]:
    """The fields of the class SGLang parses ``route``'s body into."""
    module, name = sglang_source.route_table()[route].body
    return class_fields(module, name)


def check_request(route: str, method: str, body) -> None:
    """A request as SGLang's http_server would parse it: the route must be SGLang's, the method one
    it serves, the body its class's (``{}`` for a body-less POST)."""
    table = sglang_source.route_table()
    if route not in table:
        raise UnknownRoute(f"{route}: SGLang's http_server.py serves no such route")
    r = table[route]
    if method not in r.methods:
        raise WrongMethod(f"{route}: SGLang serves it for {sorted(r.methods)}, not {method}")
    if r.body is None:
        return
    module, name = r.body
    check_object(body, class_fields(module, name), f"{route} ({name})")


SAMPLING_PARAMS = ("sglang.srt.sampling.sampling_params", "SamplingParams")


def check_sampling_params(params) -> None:
    """``/generate``'s ``sampling_params`` dict, which SGLang's tokenizer manager passes on as
    ``SamplingParams(**sampling_params)`` (tokenizer_manager.py): its keys and types are that class's."""
    check_object(params, class_fields(*SAMPLING_PARAMS), "/generate sampling_params (SamplingParams)")


_KNOWN_NAMES = {"Any", "object", "str", "bool", "int", "float", "bytes", "None"} | _SEQUENCES | _MAPPINGS
_KNOWN_HEADS = {"Optional", "Union", "Annotated", "Literal", "Tuple", "tuple"} | _SEQUENCES | _MAPPINGS


def uninterpretable(node: ast.expr, module: str, seen=None) -> List[str]:
    """The parts of annotation ``node`` that ``check_value`` could not check (empty: all of it can),
    following aliases and nested classes -- so that a new SGLang type fails a test, not a request."""
    seen = set() if seen is None else seen
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            return uninterpretable(ast.parse(node.value, mode="eval").body, module, seen)
        return []
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return uninterpretable(node.left, module, seen) + uninterpretable(node.right, module, seen)
    if isinstance(node, ast.Subscript):
        head = sglang_source._name(node.value)
        if head not in _KNOWN_HEADS:
            return [ast.unparse(node)]
        args = _args(node)
        if head == "Literal":
            return []
        if head == "Annotated":
            args = args[:1]
        return [bad for a in args for bad in uninterpretable(a, module, seen)]
    name = sglang_source._name(node)
    if name in _KNOWN_NAMES:
        return []
    found = sglang_source.find_definition(module, name) if isinstance(node, ast.Name) else None
    if found is None:
        return [f"{ast.unparse(node)} (in {module})"]
    if (found[0], name) in seen:
        return []
    seen.add((found[0], name))
    if not isinstance(found[1], ast.ClassDef):
        return uninterpretable(found[1], found[0], seen)
    if _enum_values(found[1]) is not None:
        return []
    return [bad for f in class_fields(found[0], name).values() for bad in uninterpretable(f.annotation, f.module, seen)]
