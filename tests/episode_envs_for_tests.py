"""Environments the multi-turn loop tests name by dotted path (rollout.env)."""

from megarl.environments.episode import StepResult
from megarl.environments.factory import chatml_format

OBSERVATION = "<tool_response>\n42\n</tool_response>"


class TwoToolTurns:
    """Answers the first two turns with a fixed tool response (ChatML glue), ends at the third:
    every episode has 3 generated and 2 inserted segments, whatever a random model says."""

    def __init__(self, tokenizer):
        self.format, self.turns = chatml_format(tokenizer), 0

    def reset(self, trajectory):
        return []

    def step(self, turn):
        self.turns += 1
        if self.turns == 3:
            return StepResult(done=True)
        return StepResult(insert_ids=self.format.tool_response_ids(turn.token_ids, ["42"]), tool_calls=1)


def two_tool_turns(tokenizer):
    return TwoToolTurns(tokenizer)
