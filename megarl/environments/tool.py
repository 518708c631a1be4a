"""What a tool is, how a call is read from the model's text, and how tools are named in a config.

A tool is any object with ``name``, ``description``, ``parameters`` (a JSON schema of its
arguments, what chat templates with a tools section render) and ``__call__(arguments: dict) ->
str``; it raises :class:`ToolError` for a bad call, whose message becomes the observation.

Calls are read in the Hermes / Qwen format every Qwen chat template defines (and most agent
recipes prompt other models with)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Tools are named in a config by registered name (``calculator``, ``python``) or by dotted
path (``package.module:factory``, a callable returning a tool), resolved before any rank
starts (megarl.dotted_path).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence

from megarl.dotted_path import is_dotted_path, resolve_dotted_path
from megarl.errors import ConfigError, MegarlError


class ToolError(MegarlError):
    """A tool call that cannot be answered: its message is what the model sees."""


class Tool(Protocol):
    name: str
    description: str
    parameters: dict

    def __call__(self, arguments: dict) -> str: ...


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block: the tool's name and arguments, or why the block is not a call."""

    name: Optional[str]
    arguments: Dict = field(default_factory=dict)
    error: Optional[str] = None  # malformed JSON, no name, arguments not an object
    span: tuple = (0, 0)  # characters of the block in the text


def parse_tool_calls(text: str) -> List[ToolCall]:
    """Every complete ``<tool_call>...</tool_call>`` block of ``text``, in order. A block whose body
    is not ``{"name": str, "arguments": object}`` is returned with ``error`` set (the model is told,
    the episode goes on); an opening tag without its closing one is not a call (generation stopped
    mid-call: the turn is truncated, not a tool call)."""
    calls = []
    for match in _CALL.finditer(text):
        body, span = match.group(1).strip(), match.span()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(None, error=f"tool call is not JSON: {exc.msg} at character {exc.pos}", span=span))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, error='tool call needs {"name": ..., "arguments": {...}}', span=span))
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(obj["name"], error="tool call arguments must be a JSON object", span=span))
            continue
        calls.append(ToolCall(obj["name"], arguments, span=span))
    return calls


def call_tool(tools: Dict[str, Tool], call: ToolCall) -> tuple:
    """(observation text, ok): the tool's answer, or the error the model is shown."""
    if call.error is not None:
        return f"error: {call.error}", False
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool named {call.name!r} (tools: {', '.join(sorted(tools))})", False
    try:
        return tool(call.arguments), True
    except ToolError as exc:
        return f"error: {exc}", False


def _builtin_tools() -> Dict[str, Callable[[], Tool]]:
    from megarl.environments.calculator import Calculator
    from megarl.environments.python_sandbox import PythonSandbox

    return {"calculator": Calculator, "python": PythonSandbox}


def resolve_tools(names: Sequence[str], field_name: str = "rollout.tools") -> Dict[str, Tool]:
    """Tools by registered name or dotted path (a factory called with no arguments), keyed by their
    ``name``; ConfigError naming the field for an unknown name, a bad path, a duplicate or an
    object that is not a tool."""
    builtins = _builtin_tools()
    tools: Dict[str, Tool] = {}
    for spec in names:
        if is_dotted_path(spec):
            tool = resolve_dotted_path(spec, field_name)()
        elif spec in builtins:
            tool = builtins[spec]()
        else:
            raise ConfigError(
                f"{field_name}: no tool {spec!r}; built in: {', '.join(sorted(builtins))}, "
                "or a dotted path 'package.module:factory'"
            )
        missing = [a for a in ("name", "description", "parameters") if not hasattr(tool, a)] + (
            [] if callable(tool) else ["__call__"]
        )
        if missing:
            raise ConfigError(f"{field_name}: {spec!r} made a {type(tool).__name__} without {', '.join(missing)}")
        if tool.name in tools:
            raise ConfigError(f"{field_name}: two tools named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def tool_schemas(tools: Dict[str, Tool]) -> List[dict]:
    """The OpenAI-style function schemas chat templates render in their tools section."""
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools.values()
    ]
