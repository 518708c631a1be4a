"""The loop every rank runs: the controller and its schedule, the channels between executors,
the batch they exchange, what a checkpoint keeps of the loop, replay of recorded rollouts, and
the wiring that builds a rank from run.mode and generator.backend (wiring.py)."""
