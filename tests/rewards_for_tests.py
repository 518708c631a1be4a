"""Rewards a tiny random model earns, so that test runs on text prompts update the policy."""


def even_length(response: str, answer: str, **meta) -> float:
    """1 for a response of an even number of characters: random tokens earn it about half of the time."""
    return float(len(response) % 2 == 0)


def even_length_with_answer(response: str, answer: str, **meta) -> float:
    """1 when the response and the gold answer together have an even number of characters: a random
    response earns it about half of the time, and a reward scored against another sample's answer (or
    response) differs from it about half of the time too, so recomputing it checks which pair was scored."""
    return float((len(response) + len(answer)) % 2 == 0)


def distinct_low_ids(response: str, answer: str, **meta) -> float:
    """Token-id runs (model.tokenizer: none): the distinct ids below 30 in the response, over its length.
    A random policy earns about 0.1, one spread evenly over the 30 low ids about 0.8 (16 tokens), and one
    collapsed onto a few tokens (entropy near 0, as a learning rate far too high drives it) a few
    sixteenths: the collapse loses the reward, where synthetic_low_ids would reward it."""
    ids = [int(t) for t in response.split()]
    return len({t for t in ids if t < 30}) / len(ids) if ids else 0.0
