"""An environment of tools: each turn's ``<tool_call>`` blocks are answered, the episode ends on a
turn without one and is scored by a reward function of its final answer.

The answers go back as ids of the chat template's own tool-response turn, encoded alone (the
earlier turns are never encoded again). ChatML families (Qwen2/2.5/3, SmolLM2) answer tool calls
in a user turn::

    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

(the leading ``<|im_end|>`` only when the turn stopped without one, e.g. a stop token other than
it). Qwen's templates wrap every response of one turn in its own ``<tool_response>`` block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from megarl.environments.episode import StepResult, Trajectory, Turn
from megarl.environments.tool import Tool, call_tool, parse_tool_calls


@dataclass(frozen=True)
class ChatMLToolFormat:
    """The ids a ChatML template inserts to answer tool calls; ``encode`` turns text (special tokens
    included) into ids, ``im_end_id`` ends a turn."""

    encode: Callable[[str], List[int]]
    im_end_id: int

    def tool_response_ids(self, turn_ids: List[int], results: List[str]) -> List[int]:
        body = "".join(f"<tool_response>\n{r}\n</tool_response>\n" for r in results).rstrip("\n")
        glue = "\n<|im_start|>user\n" + body + "<|im_end|>\n<|im_start|>assistant\n"
        ids = self.encode(glue)
        if not turn_ids or turn_ids[-1] != self.im_end_id:
            ids = [self.im_end_id] + ids
        return ids


class ToolEnvironment:
    """``tools`` by name; ``reward(final_text, trajectory) -> float`` scores the last turn's text."""

    def __init__(
        self,
        tools: Dict[str, Tool],
        chat_format: ChatMLToolFormat,
        reward: Optional[Callable[[str, Trajectory], float]] = None,
        max_calls_per_turn: int = 4,
    ):
        self.tools, self.format, self.reward_fn = tools, chat_format, reward
        self.max_calls_per_turn = max_calls_per_turn
        self.trajectory: Optional[Trajectory] = None
        self.tool_seconds = 0.0

    def reset(self, trajectory: Trajectory) -> List[int]:
        self.trajectory = trajectory
        return []

    def step(self, turn: Turn) -> StepResult:
        calls = parse_tool_calls(turn.text)[: self.max_calls_per_turn]
        if not calls:
            reward = self.reward_fn(turn.text, self.trajectory) if self.reward_fn else 0.0
            return StepResult(reward=reward, done=True)
        start = time.perf_counter()
        answers = [call_tool(self.tools, c) for c in calls]
        self.tool_seconds += time.perf_counter() - start
        results = [text for text, _ in answers]
        return StepResult(
            insert_ids=self.format.tool_response_ids(turn.token_ids, results),
            tool_calls=len(calls),
            tool_errors=sum(1 for _, ok in answers if not ok),
        )
