"""A loss that goes non-finite, selected by dotted path to test the trainer's guard."""

from megarl.trainer.losses import LossInputs, LossOutput, aipo


def aipo_with_nan(inputs: LossInputs, *, rho: float = 4.0) -> LossOutput:
    out = aipo(inputs, rho=rho)
    poisoned = out.per_token_loss.clone()
    poisoned[0] = poisoned[0] * float("nan")
    return LossOutput(poisoned, clipped=out.clipped)
