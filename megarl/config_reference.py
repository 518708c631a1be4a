"""The config reference, read from the typed sections themselves (megarl/config.py): each field's
type and default from its dataclass, its allowed values from ``config.CHOICES``, its meaning from
the comment beside or above it, and each section's from its docstring. `megarl config` prints it;
docs/config-reference.md is its output (tests/unit/test_config_reference.py keeps them in step).

Comments rather than ``field(metadata=...)``: the sections stay readable as plain dataclasses, and
a field added without a comment fails the test that asks every field for its description."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import re
import tokenize
import typing
from typing import Any, Dict, List, NamedTuple, Tuple

from megarl import config as config_module
from megarl.config import CHOICES, Config, did_you_mean
from megarl.errors import ConfigError

DOCS_PAGE = "docs/config-reference.md"
TOP_LEVEL = "top level"
_RULER = re.compile(r"^--.*-{3,}$")  # a comment that only separates groups of fields


class FieldDoc(NamedTuple):
    name: str  # dotted: trainer.tp
    type: str
    default: str
    choices: Tuple[Any, ...]
    description: str


class SectionDoc(NamedTuple):
    name: str  # model, reward.judge, or TOP_LEVEL for Config's own fields
    description: str
    fields: List[FieldDoc]


def _comments(source: str) -> Dict[int, str]:
    """{line number: comment text} of the module's comments."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


@functools.lru_cache(maxsize=1)
def _config_source() -> Tuple[List[str], Dict[int, str], ast.Module]:
    source = inspect.getsource(config_module)
    return source.splitlines(), _comments(source), ast.parse(source)


def _field_comments(cls: type) -> Dict[str, str]:
    """{field: its comment}: the comment lines right above it (no blank line between) and the one
    at the end of its own lines, in that order."""
    lines, comments, tree = _config_source()
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, line = [], stmt.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        beside = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        text = " ".join(c for c in above + beside if c and not _RULER.match(c))
        out[stmt.target.id] = text
    return out


def type_name(kind: Any) -> str:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        (inner,) = [a for a in args if a is not type(None)]
        return f"{type_name(inner)} or null"
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(kind):
        return "section"
    return getattr(kind, "__name__", str(kind))


def _value(value: Any) -> str:
    """A value as it is written in a YAML config."""
    return json.dumps(value) if not isinstance(value, str) else value


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _section(name: str, cls: type, skip_sections: bool) -> Tuple[SectionDoc, List[Tuple[str, type]]]:
    hints, comments = typing.get_type_hints(cls), _field_comments(cls)
    fields, nested = [], []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        dotted = f.name if name == TOP_LEVEL else f"{name}.{f.name}"
        if dataclasses.is_dataclass(kind):
            nested.append((dotted, kind))
            if skip_sections:
                continue
            default = f"(section {dotted})"
        else:
            default = _value(_default(f))
        fields.append(FieldDoc(dotted, type_name(kind), default, CHOICES.get(dotted, ()), comments[f.name]))
    return SectionDoc(name, _docstring(cls), fields), nested


def _docstring(cls: type) -> str:
    """The class's own docstring; '' for the signature @dataclass writes in its place."""
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())


def sections() -> List[SectionDoc]:
    """Every section in the order a config file lists them, a nested one after its parent."""
    top, todo = _section(TOP_LEVEL, Config, skip_sections=True)
    out = []
    while todo:
        name, cls = todo.pop(0)
        doc, nested = _section(name, cls, skip_sections=False)
        out.append(doc)
        todo[:0] = nested
    return out + [top]


def _field_markdown(f: FieldDoc) -> str:
    allowed = f": {' | '.join(f'`{_value(c)}`' for c in f.choices)}" if f.choices else ""
    return f"- **`{f.name}`** ({f.type}{allowed}; default `{f.default}`): {f.description}"


def section_markdown(section: SectionDoc) -> str:
    parts = [f"## {section.name}", ""]
    if section.description:
        parts += [section.description, ""]
    parts += [_field_markdown(f) for f in section.fields]
    return "\n".join(parts) + "\n"


HEADER = f"""# Configuration reference

Every field of a `megarl train` / `megarl sft` config: its type, default, allowed values and what it
does. Generated by `megarl config > {DOCS_PAGE}` from the typed sections in megarl/config.py (each
field's comment, each section's docstring); tests/unit/test_config_reference.py fails when this page
is stale or a field has no description. `megarl config SECTION` prints one section.

A config is a YAML (or JSON) file of these sections; a field is overridden on the command line as
`section.field=value`, e.g. `megarl train --config configs/tiny_cpu.yaml rollout.samples_per_prompt=8`.
A field not listed here is refused, with the nearest name.
"""


def reference_markdown() -> str:
    return HEADER + "".join("\n" + section_markdown(s) for s in sections())


def lookup(name: str) -> str:
    """`megarl config NAME`: one section (trainer, reward.judge) or one field (rollout.max_lag)."""
    docs = sections()
    for s in docs:
        if s.name == name:
            return section_markdown(s)
    fields = {f.name: f for s in docs for f in s.fields}
    if name in fields:
        return _field_markdown(fields[name]) + "\n"
    names = [s.name for s in docs if s.name != TOP_LEVEL] + list(fields)
    raise ConfigError(f"megarl config {name}: no such section or field{did_you_mean(name, names)}")


def undescribed() -> List[str]:
    """Fields (and sections) with no description: what the reference test refuses."""
    out = [f"{s.name} (section docstring)" for s in sections() if s.name != TOP_LEVEL and not s.description]
    return out + [f.name for s in sections() for f in s.fields if not f.description.strip()]
