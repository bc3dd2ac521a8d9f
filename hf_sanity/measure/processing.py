"""The tokenizer behind a trainer's processing class: one unwrap for every reader of it."""

from __future__ import annotations


def text_tokenizer(processing_class):
    """The tokenizer that turns text into ids: a processor's own ``tokenizer`` (vision-language models), or
    the tokenizer itself; None stays None."""
    return getattr(processing_class, "tokenizer", processing_class)


def trainer_tokenizer(trainer):
    """The tokenizer a trainer tokenizes with (its ``processing_class``, unwrapped), or None without one."""
    return text_tokenizer(getattr(trainer, "processing_class", None))
