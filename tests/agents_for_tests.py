"""Agent programs the OpenAI-endpoint loop test names by dotted path (rollout.agent): plain `openai`
client loops, written as a user's agent would be."""

import openai

SYSTEM = "You are an agent with one tool, lookup."
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "looks a thing up",
                                           "parameters": {"type": "object"}}}  # fmt: skip


def two_call_agent(task):
    """Two calls whatever the model says: the first answered with a tool result of 42 (a random
    model makes no tool call, so the agent answers as if it had), then the agent returns."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}] + task.messages
    r = client.chat.completions.create(model=task.model, messages=messages, tools=[LOOKUP])
    messages += [r.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": "call_0", "content": "42"}]
    client.chat.completions.create(model=task.model, messages=messages, tools=[LOOKUP])
