"""No function in megarl/weight_sync/ takes more than 8 parameters.

Endpoints once took 13-14 positional settings (spec, both layouts, fp8, verify, wire dtype, bucket
bytes, ...), each caller repeating them in its own order; they now travel as the frozen settings of
weight_sync/settings.py (``SyncGeometry``: between which layouts, ``WireFormat``: what is sent and
how). This test walks the AST of every module there so a new long signature fails here, not review.
``self`` / ``cls`` do not count; ``*args`` and ``**kwargs`` count one each.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

import pytest

WEIGHT_SYNC = Path(__file__).resolve().parents[2] / "megarl" / "weight_sync"
MAX_PARAMETERS = 8


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    n = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if in_class and not is_static and names and names[0] in ("self", "cls"):
        n -= 1
    return n


def functions(tree: ast.AST) -> Iterator[Tuple[str, int, int]]:
    """(qualified name, line, parameter count) of every function and method, nested ones included."""

    def walk(node: ast.AST, prefix: str, in_class: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.", True)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child.lineno, parameter_count(child, in_class)
                yield from walk(child, f"{prefix}{child.name}.", False)
            else:
                yield from walk(child, prefix, in_class)

    yield from walk(tree, "", False)


def too_long(source: str):
    return [(name, line, n) for name, line, n in functions(ast.parse(source)) if n > MAX_PARAMETERS]


def test_no_weight_sync_function_takes_more_than_eight_parameters():
    modules = sorted(WEIGHT_SYNC.glob("*.py"))
    assert len(modules) >= 10, modules  # the walk reads the package, not an empty folder
    found = [f"{path.name}:{line} {name} takes {n}" for path in modules for name, line, n in too_long(path.read_text())]
    assert not found, "bundle them into weight_sync/settings.py's frozen settings:\n" + "\n".join(found)


# -- the walk itself catches what it must: each case here is a signature the package once had --------


@pytest.mark.parametrize(
    "source, want",
    [
        # GeneratorSync.__init__ before the settings: 14 parameters besides self
        (
            "class GeneratorSync:\n"
            "    def __init__(self, spec, trainer, generator, replica, tp_rank, params, group, fp8=False,\n"
            "                 wire_dtype=None, bucket_bytes=0, verify=False, plan=None, ipc_peers=None,\n"
            "                 norm_names='local'):\n"
            "        pass\n",
            [("GeneratorSync.__init__", 2, 14)],
        ),
        # keyword-only and starred parameters count; a nested function is read too
        (
            "def f(a, b, *args, c, d, e, f, g, **kw):\n    def inner(a, b, c, d, e, f, g, h, i): pass\n",
            [("f", 1, 9), ("f.inner", 2, 9)],
        ),
        # a static method's first parameter is a parameter, even when it is called self
        ("class C:\n    @staticmethod\n    def s(self, a, b, c, d, e, f, g, h): pass\n", [("C.s", 3, 9)]),
        # exactly eight, besides self, is allowed
        ("class C:\n    def m(self, a, b, c, d, e, f, g, h): pass\n", []),
    ],
)
def test_the_walk_counts_what_a_caller_passes(source, want):
    assert too_long(source) == want
