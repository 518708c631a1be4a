"""Executors (LlamaRL section 5): each owns its ranks and implements init / step /
save_checkpoint / get_output. The controller (controller.py) drives them."""
