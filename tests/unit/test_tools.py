"""Tools for multi-turn episodes: the calculator's arithmetic (exact, and refusing anything that is
not arithmetic), tool calls read from Hermes / Qwen-style text, and tools named in a config."""

import pytest

from megarl.environments.calculator import Calculator, evaluate
from megarl.environments.tool import ToolCall, ToolError, call_tool, parse_tool_calls, resolve_tools, tool_schemas
from megarl.errors import ConfigError


@pytest.mark.parametrize(
    "expression,value",
    [
        ("123456789 * 987654321", "121932631112635269"),  # exact, past float's 2^53
        ("(2 + 3) * 4 - 6 / 4", "18.5"),
        ("7 // 2 + -7 % 3", "5"),  # Python's floor division and modulo: 3 + 2
        ("2 ^ 10", "1024"),  # what models write for a power
        ("12 × 3 ÷ 4", "9"),
        ("1_000 * 3", "3000"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("2 ** -2", "0.25"),
    ],
)
def test_calculator_values(expression, value):
    assert Calculator()({"expression": expression}) == value


@pytest.mark.parametrize(
    "expression,message",
    [
        ("__import__('os').system('true')", "not arithmetic"),
        ("x + 1", "not arithmetic"),
        ("(1).real", "not arithmetic"),
        ("'ab' * 3", "not arithmetic"),
        ("1 < 2", "not arithmetic"),
        ("[1, 2]", "not arithmetic"),
        ("9 ** 9 ** 9", "exponent"),
        ("10 ** 4096", "digits"),
        ("(10 ** 3000) * (10 ** 3000)", "digits"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e308 * 10", "not a finite number"),
        ("2 +", "cannot parse"),
        ("", "empty"),
        ("-(" * 70 + "1" + ")" * 70, "nested"),
        ("1+" * 300 + "1", "longer than"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


def test_calculator_arguments_are_checked():
    with pytest.raises(ToolError, match="one argument, 'expression'"):
        Calculator()({"expr": "1+1"})
    with pytest.raises(ToolError, match="must be a string"):
        Calculator()({"expression": 3})


def test_tool_calls_read_from_text():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>\n'
        'then <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}'  # no closing tag
    )
    calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["calculator", "python", None, None, "calculator"]
    assert calls[0].arguments == {"expression": "12 * 7"} and calls[0].error is None
    assert text[calls[0].span[0] : calls[0].span[1]].startswith("<tool_call>")
    assert calls[1].arguments == {"code": "print(1)"}  # arguments written as a JSON string
    assert calls[2].error.startswith("tool call is not JSON")
    assert "name" in calls[3].error and "JSON object" in calls[4].error
    assert parse_tool_calls("no calls here") == []


def test_calling_tools_gives_an_observation_and_whether_it_worked():
    tools = resolve_tools(["calculator"])
    assert call_tool(tools, ToolCall("calculator", {"expression": "6 * 7"})) == ("42", True)
    text, ok = call_tool(tools, ToolCall("calculator", {"expression": "1/0"}))
    assert not ok and text == "error: division by zero"
    text, ok = call_tool(tools, ToolCall("search", {"q": "x"}))
    assert not ok and "no tool named 'search'" in text and "calculator" in text
    text, ok = call_tool(tools, ToolCall(None, error="tool call is not JSON"))
    assert not ok and text == "error: tool call is not JSON"


class Echo:
    name, description = "echo", "returns its text"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

    def __call__(self, arguments):
        return arguments["text"]


def make_echo():
    return Echo()


def make_not_a_tool():
    return object()


def test_tools_by_name_or_dotted_path_and_their_schemas():
    tools = resolve_tools(["calculator", "python", "tests.unit.test_tools:make_echo"])
    assert sorted(tools) == ["calculator", "echo", "python"]
    assert tools["echo"]({"text": "hi"}) == "hi"
    schemas = {s["function"]["name"]: s["function"] for s in tool_schemas(tools)}
    assert schemas["calculator"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ConfigError, match="rollout.tools: no tool 'search'; built in: calculator, python"):
        resolve_tools(["search"])
    with pytest.raises(ConfigError, match="rollout.tools: two tools named 'calculator'"):
        resolve_tools(["calculator", "calculator"])
    with pytest.raises(ConfigError, match="made a object without name, description, parameters, __call__"):
        resolve_tools(["tests.unit.test_tools:make_not_a_tool"])
    with pytest.raises(ConfigError, match="rollout.tools: module 'tests.unit.test_tools' has no attribute"):
        resolve_tools(["tests.unit.test_tools:missing"])
