"""Which backend a replica's generator executor gets: the plain one, or episodes over it.

``episode_backend(rollout, inner, tokenizer, max_context)``: with ``rollout.tools`` each sample is
an episode of :class:`~megarl.environments.tool_env.ToolEnvironment` (its tool calls answered in
the tokenizer's ChatML turns); with ``rollout.env`` one of ``factory(tokenizer)``; with
``rollout.agent`` the agent's calls to an OpenAI-compatible endpoint (agent_env.py); otherwise the
inner backend unchanged. ``prompt_renderer(rollout, tokenizer)``: with ``rollout.tools``, how every
prompt (training and evaluation sets alike) is rendered: the tools' schemas in the chat template's
tools section, or megarl's tools text in the system message for templates without one
(chat_render.py), as an OpenAI client's request with ``tools`` would be.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from megarl.dotted_path import resolve_dotted_path
from megarl.environments.chat_render import ChatRenderer
from megarl.environments.episode import EpisodeSettings
from megarl.environments.multi_turn import MultiTurnBackend
from megarl.environments.tool import resolve_tools, tool_schemas
from megarl.environments.tool_env import ChatMLToolFormat, ToolEnvironment
from megarl.errors import ConfigError
from megarl.generator.interface import GeneratorBackend

IM_END = "<|im_end|>"


def chatml_format(tokenizer) -> ChatMLToolFormat:
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if not isinstance(im_end, int) or im_end == tokenizer.unk_token_id or im_end is None:
        raise ConfigError(
            f"rollout.tools: the tokenizer has no {IM_END} token; megarl answers tool calls in ChatML turns "
            "(Qwen, SmolLM2) so far: give other families an environment of their own (rollout.env)"
        )
    return ChatMLToolFormat(lambda text: tokenizer.encode(text, add_special_tokens=False), im_end)


def prompt_renderer(rollout, tokenizer) -> Optional[Callable[[List[dict]], List[int]]]:
    """Messages -> prompt ids with the tools described, or None (the plain chat template) without tools."""
    if not rollout.tools:
        return None
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "rollout.tools: the tools are described in the prompt, which needs a tokenizer with a chat template"
        )
    renderer, schemas = ChatRenderer(tokenizer), tool_schemas(resolve_tools(rollout.tools))
    return lambda messages: renderer.render_first(messages, schemas)


def episode_backend(rollout, inner: GeneratorBackend, tokenizer, max_context: int) -> GeneratorBackend:
    if not rollout.tools and rollout.env is None and rollout.agent is None:
        return inner
    settings = EpisodeSettings(
        max_turns=rollout.max_turns,
        max_context=max_context,
        env_timeout_s=rollout.env_timeout_s,
        env_workers=rollout.env_workers,
    )
    on_close = []
    if rollout.tools:
        tools, fmt = resolve_tools(rollout.tools), chatml_format(tokenizer)

        def make_env(i):
            return ToolEnvironment(tools, fmt)

    elif rollout.agent is not None:
        from megarl.environments.agent_env import agent_environments
        from megarl.environments.openai_endpoint import Sampling
        from megarl.generator.tokenizer import stop_ids

        sampling = Sampling(rollout.temperature, rollout.top_p)
        make_env, endpoint = agent_environments(
            rollout.agent, tokenizer, stop_ids(tokenizer), sampling, rollout.env_timeout_s + 5.0
        )
        on_close.append(endpoint.close)
    else:
        factory = resolve_dotted_path(rollout.env, "rollout.env")

        def make_env(i):
            return factory(tokenizer)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=False)

    return MultiTurnBackend(inner, make_env, decode, settings, on_close=on_close)
