"""Constants of the Hugging Face training stack that hf-sanity reads everywhere."""

IGNORE_INDEX = -100  # a label that carries no loss (PyTorch cross_entropy's ignore_index, HF's label padding)
