"""Rewards a tiny random model earns, so that test runs on text prompts update the policy."""


def even_length(response: str, answer: str, **meta) -> float:
    """1 for a response of an even number of characters: random tokens earn it about half of the time."""
    return float(len(response) % 2 == 0)


def even_length_with_answer(response: str, answer: str, **meta) -> float:
    """1 when the response and the gold answer together have an even number of characters: a random
    response earns it about half of the time, and a reward scored against another sample's answer (or
    response) differs from it about half of the time too, so recomputing it checks which pair was scored."""
    return float((len(response) + len(answer)) % 2 == 0)
