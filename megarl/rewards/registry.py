"""Reward functions by name: the built-ins and any user function named by dotted path.

A reward function is ``fn(response_text: str, answer: str, **kwargs) -> float``;
``kwargs`` carries the prompt record's ``meta`` fields. The config field
``reward.function`` holds either a registered name (``"math"``) or a
``package.module:function`` path, so user rewards need no change to megarl.
"""

from __future__ import annotations

from typing import Callable, Dict

from megarl.dotted_path import is_dotted_path, resolve_dotted_path
from megarl.errors import ConfigError

RewardFn = Callable[..., float]

FIELD = "reward.function"

_REGISTRY: Dict[str, RewardFn] = {}


def register_reward(name: str):
    """Decorator: make ``fn`` resolvable as ``name`` (e.g. ``reward.function: math``)."""

    def decorator(fn: RewardFn) -> RewardFn:
        existing = _REGISTRY.get(name)
        # Re-importing the same module (e.g. in a spawned scoring worker) re-registers the
        # same function; a different function under a taken name is a mistake.
        if existing is not None and _qualified_name(existing) != _qualified_name(fn):
            raise ConfigError(f"reward name {name!r} is already registered to {_qualified_name(existing)}")
        _REGISTRY[name] = fn
        return fn

    return decorator


def registered_rewards() -> Dict[str, RewardFn]:
    _load_builtins()
    return dict(_REGISTRY)


def resolve_reward(name_or_path: str) -> RewardFn:
    """A built-in/registered name or ``package.module:function`` -> the function.

    Raises ConfigError naming ``reward.function`` when it cannot be resolved.
    """
    if callable(name_or_path):
        return name_or_path
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ConfigError(f"{FIELD}: expected a reward name or 'package.module:function', got {name_or_path!r}")
    spec = name_or_path.strip()
    _load_builtins()
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if not is_dotted_path(spec):
        raise ConfigError(
            f"{FIELD}: {spec!r} is not a built-in reward ({', '.join(sorted(_REGISTRY))}) "
            f"and not a dotted path of the form 'package.module:function'"
        )
    return resolve_dotted_path(spec, FIELD)


def reward_spec(fn_or_spec) -> str:
    """A string that resolves to the same function in another process.

    Scoring runs in spawned workers, which receive the spec rather than a pickled
    function; a lambda or a function local to another function has no such name.
    """
    if isinstance(fn_or_spec, str):
        resolve_reward(fn_or_spec)  # fail here, in the caller, rather than in a worker
        return fn_or_spec.strip()
    if not callable(fn_or_spec):
        raise ConfigError(f"{FIELD}: expected a function or its name, got {type(fn_or_spec).__name__}")
    spec = _qualified_name(fn_or_spec)
    try:
        same = resolve_reward(spec) is fn_or_spec
    except ConfigError:
        same = False
    if not same:
        raise ConfigError(
            f"{FIELD}: {spec} cannot be imported by name in a scoring worker; "
            f"define the reward as a module-level function and give its 'package.module:function' path"
        )
    return spec


def _qualified_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _load_builtins() -> None:
    # Imported lazily: the built-ins import this module to register themselves.
    from megarl.rewards import math_verify_reward, repeat, synthetic  # noqa: F401
