"""Chat messages to token ids for an episode that only grows: the first call's whole context, then
each later call's new messages alone, as the ids the chat template puts after the turn the model
sampled. Earlier turns are never rendered or encoded again.

The ids of new messages come from rendering them after a fixed two-message base whose assistant
content is a sentinel: everything the template writes after the sentinel (its end-of-turn marker,
the new messages, the generation prompt) is the glue. Rendering from a base, not the episode's own
history, keeps templates that rewrite earlier turns (Qwen3 drops an earlier turn's thinking) from
changing what is inserted. Where the sampled turn already ended with the stop token the template's
marker begins with (``<|im_end|>``), the glue starts after it.

Templates without a tools section or a ``tool`` role (SmolLM2's shipped one) get the Hermes / Qwen
convention written by megarl: the tool schemas in the system message and tool results in a user
turn of ``<tool_response>`` blocks, what the calculator environment inserts too (tool_env.py).
"""

from __future__ import annotations

import json
from typing import List, Optional, Sequence

SENTINEL = "\u2063megarl-sentinel\u2063"
_BASE = [{"role": "user", "content": "\u2063"}, {"role": "assistant", "content": SENTINEL}]

TOOLS_PREAMBLE = (
    "# Tools\n\nYou can call the functions below. Their signatures, one JSON object per line:\n<tools>\n{schemas}\n"
    "</tools>\n\nTo call one, answer with a JSON object naming it and giving its arguments, inside "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n'
    "</tool_call>"
)


class ChatRenderer:
    """``render_first(messages, tools)`` -> the ids of a whole first context with the generation
    prompt; ``render_after(turn_ids, messages, tools)`` -> the ids that follow a sampled turn for
    ``messages`` (the ones after the assistant turn). ``tokenizer`` is transformers' with a chat
    template; ``stop_ids`` the end-of-turn ids a sampled turn may end with."""

    def __init__(self, tokenizer, stop_ids: Sequence[int] = ()):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the OpenAI chat endpoint needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.template_has_tools = "tools" in template
        self.template_has_tool_role = "'tool'" in template or '"tool"' in template
        self.stop_text = {i: tokenizer.decode([i], skip_special_tokens=False) for i in stop_ids}

    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render(self, messages: List[dict], tools: Optional[list], generation_prompt: bool) -> str:
        messages = self._messages_for_template(messages, tools)
        kwargs = {"tools": tools} if tools and self.template_has_tools else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _messages_for_template(self, messages: List[dict], tools: Optional[list]) -> List[dict]:
        out = []
        for m in messages:
            m = {k: v for k, v in m.items() if v is not None}
            if m.get("role") == "tool" and not self.template_has_tool_role:
                body = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
                if out and out[-1].get("_tool_responses"):  # one user turn for a turn's responses
                    out[-1]["content"] += "\n" + body
                    continue
                m = {"role": "user", "content": body, "_tool_responses": True}
            out.append(m)
        out = [{k: v for k, v in m.items() if k != "_tool_responses"} for m in out]
        return out

    def template_input(self, messages: List[dict], tools: Optional[list] = None) -> tuple:
        """(messages, apply_chat_template keyword arguments) of a conversation with ``tools``: the
        template's own tools section where it has one, else megarl's tools text in the system
        message, and ``tool`` messages as user turns of ``<tool_response>`` blocks where it has no
        tool role. What render_first renders, and what `megarl sft` renders a record with tools by."""
        messages = list(messages)
        if tools and not self.template_has_tools:
            preamble = TOOLS_PREAMBLE.format(schemas="\n".join(json.dumps(t) for t in tools))
            if messages and messages[0].get("role") == "system":
                messages[0] = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{preamble}"}
            else:
                messages.insert(0, {"role": "system", "content": preamble})
        kwargs = {"tools": tools} if tools and self.template_has_tools else {}
        return self._messages_for_template(messages, tools), kwargs

    def render_first(self, messages: List[dict], tools: Optional[list] = None) -> List[int]:
        messages, kwargs = self.template_input(messages, tools)
        return self.encode(
            self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        )

    def render_after(self, turn_ids: List[int], messages: List[dict], tools: Optional[list] = None) -> List[int]:
        full = self._render(_BASE + list(messages), tools, True)
        glue = full[full.index(SENTINEL) + len(SENTINEL) :]
        stop = self.stop_text.get(turn_ids[-1]) if turn_ids else None
        if stop and glue.startswith(stop):  # the sampled turn holds the template's end marker already
            glue = glue[len(stop) :]
        return self.encode(glue)
