"""A function named by dotted path in a config: ``package.module:function`` (or ``module:Class.method``).

One resolver for every config field that names user code (``trainer.loss``, ``reward.function``):
each error names the field, the path, and the module or attribute that was not found, so a typo
is refused before any rank starts with the reason beside it.
"""

from __future__ import annotations

import importlib
from typing import Callable

from megarl.errors import ConfigError


def is_dotted_path(spec: str) -> bool:
    """Whether ``spec`` has the form 'package.module:attribute' (rather than a registered name)."""
    return ":" in spec


def resolve_dotted_path(spec: str, field: str) -> Callable:
    """The callable ``spec`` ('package.module:attribute[.attribute...]') names; ConfigError naming ``field``."""
    module_name, _, attr_path = spec.strip().partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"{field}: {spec!r} is not a dotted path of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises while it is imported
        raise ConfigError(
            f"{field}: cannot import module {module_name!r} of {spec!r}: {type(exc).__name__}: {exc}"
        ) from exc
    obj = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{field}: module {module_name!r} has no attribute {attr_path!r} (from {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{field}: {spec!r} is a {type(obj).__name__}, not a function")
    return obj
