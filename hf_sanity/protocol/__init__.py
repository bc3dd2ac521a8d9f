"""The ordered debugging protocol: `overfit` a handful of examples, then `diagnose` layer by layer.

>>> from hf_sanity.protocol import overfit, diagnose
>>> report = overfit(trainer=trainer)          # does the pipeline learn? if not, which link is broken
>>> report = diagnose(trainer=trainer)         # five layers, stops at the first broken one

Both work on copies: the user's trainer, model and RNG states are left exactly as they were.
"""

from hf_sanity.protocol.diagnose import diagnose, overfit

__all__ = ["diagnose", "overfit"]
