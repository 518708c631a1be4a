"""Rewards a tiny random model earns, so that test runs on text prompts update the policy."""


def even_length(response: str, answer: str, **meta) -> float:
    """1 for a response of an even number of characters: random tokens earn it about half of the time."""
    return float(len(response) % 2 == 0)
