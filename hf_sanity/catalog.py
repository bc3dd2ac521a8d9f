"""The rule catalog: every rule is declared once, with the text that `explain`, the docs page and
each finding's fix come from.

A rule module declares its rule with :func:`define` next to the code that detects it::

    PROMPT_IN_LOSS = define(
        "prompt-in-loss", severity="warning", stage="tokens",
        symptom="Model repeats the prompt back.",
        detects="Fraction of supervised tokens that lie in prompt turns.",
        fix="Compute the loss on completions only ...",
    )

    @PROMPT_IN_LOSS.check
    def check(ctx): ...
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hf_sanity.errors import UserInputError
from hf_sanity.findings import SEVERITIES, Finding, Severity

# Where a rule runs. Order is the order of the docs page.
STAGES: dict[str, str] = {
    "data": "Dataset rows, before tokenization (preflight)",
    "tokens": "Tokenized examples: masks, lengths, EOS (preflight, and the callback's first batch)",
    "template": "Chat template parity between training and inference (preflight)",
    "model": "Model, embeddings and adapter (preflight)",
    "trainer": "The Trainer's setup: collator, packing, accumulation, checkpointing (preflight with a trainer)",
    "training": "Per-step signals of a running Trainer (SanityCallback)",
    "curves": "Shapes of the loss and eval curves (SanityCallback online, doctor on logged runs)",
    "protocol": "The ordered debugging protocol (overfit, diagnose)",
    "runs": "Finished runs and their logs (doctor)",
    "internal": "hf-sanity itself",
}


@dataclass
class Rule:
    slug: str
    severity: Severity
    stage: str
    symptom: str
    detects: str
    fix: str
    # A preflight check: ``check(context) -> Iterable[Finding]``. Rules detected elsewhere (monitors,
    # curve analysis) leave it None and are detected by the module that defines them.
    checker: Callable[[Any], Iterable[Finding]] | None = field(default=None, repr=False)
    module: str = ""

    def check(self, fn: Callable[[Any], Iterable[Finding]]) -> Callable[[Any], Iterable[Finding]]:
        """Decorator: register ``fn`` as this rule's preflight check."""
        self.checker = fn
        return fn

    def finding(
        self,
        message: str,
        *,
        evidence: dict[str, Any] | None = None,
        fix: str | None = None,
        step: int | None = None,
        example: Any = None,
        severity: Severity | None = None,
    ) -> Finding:
        """A finding of this rule; the fix defaults to the catalog's fix."""
        return Finding(
            rule=self.slug,
            severity=severity or self.severity,
            message=message,
            evidence=evidence or {},
            fix=fix or self.fix,
            step=step,
            example=example,
        )

    def explain(self) -> str:
        """The rule's text as Markdown: the same text the docs page and `hf-sanity explain` show."""
        return (
            f"## `{self.slug}`\n\n"
            f"*{self.severity}* · stage: {self.stage}\n\n"
            f"**Symptom.** {self.symptom}\n\n"
            f"**How it is detected.** {self.detects}\n\n"
            f"**Fix.** {self.fix}\n"
        )


_RULES: dict[str, Rule] = {}

# Every module that defines rules. Importing them fills the catalog.
RULE_MODULES = (
    "hf_sanity.rules.internal",
    "hf_sanity.rules.data",
    "hf_sanity.rules.masks",
    "hf_sanity.rules.lengths",
    "hf_sanity.rules.template",
    "hf_sanity.rules.model",
    "hf_sanity.rules.adapter",
    "hf_sanity.rules.trainer_setup",
    "hf_sanity.rules.training",
    "hf_sanity.rules.curves",
    "hf_sanity.rules.runs",
    "hf_sanity.rules.protocol",
)


def define(
    slug: str,
    *,
    severity: Severity,
    stage: str,
    symptom: str,
    detects: str,
    fix: str,
) -> Rule:
    """Declare a rule. Each slug is declared exactly once."""
    if severity not in SEVERITIES:
        raise ValueError(f"{slug}: severity must be one of {SEVERITIES}")
    if stage not in STAGES:
        raise ValueError(f"{slug}: stage must be one of {list(STAGES)}")
    if slug in _RULES:
        raise ValueError(f"rule {slug!r} is declared twice ({_RULES[slug].module})")
    caller = sys._getframe(1).f_globals.get("__name__", "")  # inspect.stack() reads source: seconds
    rule = Rule(slug, severity, stage, symptom.strip(), detects.strip(), fix.strip(), module=caller)
    _RULES[slug] = rule
    return rule


_loaded = False


def load() -> dict[str, Rule]:
    """Import every rule module (once) and return the catalog."""
    global _loaded
    if not _loaded:
        for name in RULE_MODULES:
            importlib.import_module(name)
        _loaded = True
    return _RULES


def all_rules() -> list[Rule]:
    """Every rule, ordered by stage then slug."""
    order = list(STAGES)
    return sorted(load().values(), key=lambda r: (order.index(r.stage), r.slug))


def get(slug: str) -> Rule:
    rules = load()
    if slug not in rules:
        raise UserInputError(f"unknown rule {slug!r}; `hf-sanity rules` lists the {len(rules)} rules")
    return rules[slug]
