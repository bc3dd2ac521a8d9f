"""The options `overfit` and `diagnose` share, in Python and on the command line: one definition each."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from hf_sanity.errors import UserInputError

MIN_EXAMPLES, MAX_EXAMPLES = 2, 10


@dataclass(frozen=True)
class ProtocolOptions:
    """How the protocol samples and trains the examples.

    ``n``: examples to overfit (2-10); ``steps``: the overfit's step budget (per LR tried when the LR is
    searched, at most 3 budgets in all); ``lr``: the overfit learning rate, used as is (default: the setup's fixed
    step-1 LR, then searched by step 4 when needed, see `hf_sanity.protocol.lr_search`); ``max_len``: the training max_length (truncation keeps the start);
    ``loss_on``: ``completion`` (labels on completions only) or ``all``; ``format``: the dataset format
    (default: detected from the columns); ``alpaca_template``: ``chat`` or ``text`` for Alpaca rows (default:
    chat when the tokenizer has a chat template).
    """

    n: int = 8
    steps: int = 300
    lr: float | None = None
    max_len: int | None = None
    loss_on: str = "completion"
    format: str | None = None
    alpaca_template: str | None = None

    def __post_init__(self) -> None:
        from hf_sanity.measure.formats import check_alpaca_template

        check_alpaca_template(self.alpaca_template)
        if not MIN_EXAMPLES <= self.n <= MAX_EXAMPLES:
            raise UserInputError(
                f"--n must be between {MIN_EXAMPLES} and {MAX_EXAMPLES} examples, got {self.n}"
            )
        if self.steps < 1:
            raise UserInputError(f"--steps must be at least 1, got {self.steps}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise UserInputError(f"--lr must be a positive number, got {self.lr}")
        if self.max_len is not None and self.max_len <= 0:
            raise UserInputError(f"--max-len must be positive, got {self.max_len}")
        if self.loss_on not in ("completion", "all"):
            raise UserInputError(f"--loss-on must be 'completion' or 'all', got {self.loss_on!r}")

    @classmethod
    def of(cls, options: ProtocolOptions | None = None, **values: Any) -> ProtocolOptions:
        """``options`` (or the defaults) with ``values`` set; an unknown name is a TypeError, as for a function."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"unexpected option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return replace(options or cls(), **values)
