"""The rule catalog: every rule is declared once, with the text that `explain`, the docs page and each
finding's fix come from, and with the detectors that find it.

A rule module under `hf_sanity.rules` declares its rule with :func:`define` and registers its detector right
below it. The detector's *kind* says what it reads; the drivers ask the catalog for the detectors of their
kind and never list them by hand::

    PROMPT_IN_LOSS = define("prompt-in-loss", severity="warning", stage="tokens", symptom=..., detects=..., fix=...)

    @PROMPT_IN_LOSS.check                            # kind "context": preflight, the callback's first batch
    def check_prompt_in_loss(ctx): ...

    @LOSS_SPIKE.detector("curve", online=True)       # kind "curve": SanityCallback while training, doctor
    def loss_spike(curves): ...

    @NEVER_STOPS.detector("outputs")                 # kind "outputs": what the model generated (outputs)
    def never_stops(generations): ...

    @monitor                                          # kind "step": a Monitor class fed per-step values
    class GradientMonitor(Monitor):
        rules = (NONFINITE_GRAD, GRAD_EXPLOSION)

Rule modules are discovered: every module under `hf_sanity.rules` is imported by :func:`load`. Importing them
needs neither torch nor transformers, so `hf-sanity rules` and option validation stay fast.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import pkgutil
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hf_sanity import progress
from hf_sanity.errors import UserInputError
from hf_sanity.findings import SEVERITIES, Finding, Severity
from hf_sanity.measure.objective import ANY, SFT
from hf_sanity.measure.objective import KINDS as OBJECTIVE_KINDS
from hf_sanity.remedies import RemedyDoc

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
    "outputs": "What the fine-tuned model generates for held-out prompts (outputs, and the callback's "
    "generate_every)",
    "internal": "hf-sanity itself",
}

# What a detector reads, and which driver feeds it.
KINDS: dict[str, str] = {
    "context": "a preflight Context (`hf_sanity.measure.context`): preflight, and the callback's first batch",
    "step": "per-step values of a running Trainer: a Monitor class that SanityCallback feeds",
    "curve": "logged loss and eval curves (`hf_sanity.measure.curves.Curves`): SanityCallback, doctor",
    "runs": "several finished runs and their predictions (`hf_sanity.measure.runs.RunSet`): doctor",
    "protocol": "a measurement of the debugging protocol (overfit run, LR sweep, precision run): overfit, diagnose",
    "outputs": "greedy generations for held-out prompts (`hf_sanity.measure.generate.Generations`): outputs, and "
    "SanityCallback(generate_every=...) at evaluations",
    "saved": "a folder the model was saved to (`hf_sanity.measure.saved.SavedFolder`): SanityCallback at each "
    "checkpoint the Trainer saves; `served` and `outputs` on the folder the model is loaded from",
}


@dataclass(frozen=True)
class Detector:
    """One way a rule is detected. ``fn`` takes what its kind reads and returns findings (for kind "step",
    ``fn`` is a Monitor class). ``online``: SanityCallback runs it while training; ``final``: it judges a whole
    run, so the callback runs it at train end only; ``reads``: the measurement type a protocol detector reads."""

    rule: str
    kind: str
    fn: Callable[..., Any] = field(repr=False)
    online: bool = False
    final: bool = False
    reads: type | None = None
    applies: Callable[[Any], bool] | None = None  # whether there is anything to check on this input

    @property
    def name(self) -> str:
        return f"{self.fn.__module__}.{self.fn.__qualname__}"


@dataclass
class Rule:
    slug: str
    severity: Severity
    stage: str
    symptom: str
    detects: str
    fix: str
    module: str = ""
    # Rules that must pass first: when one of them finds an error on the same input, this rule's detectors
    # are skipped (they would measure nonsense or crash), and the report says so once (`checks-skipped`).
    needs: tuple[str, ...] = ()
    # Rules whose finding explains this one's symptom on the same run: when one of them fired, this one is
    # not reported (a diverged run also "underfits"; a loss scaled by the accumulation factor sits "above eval").
    explained_by: tuple[str, ...] = ()
    # The training objectives (`measure.objective.KINDS`) the rule is written for: on a run of another
    # objective its detectors do not run (an SFT rule never reads a DPO pair or a GRPO rollout as a sequence).
    objectives: frozenset[str] = SFT
    # What `hf-sanity fix` can do about a finding of this rule (its findings carry the concrete Remedy).
    remedy: RemedyDoc | None = None
    detectors: list[Detector] = field(default_factory=list, repr=False)

    def applies_to(self, objective: str | None) -> bool:
        """Whether the rule is written for ``objective`` (a kind; None: any)."""
        return objective is None or objective in self.objectives

    def detector(
        self,
        kind: str,
        *,
        online: bool = False,
        final: bool = False,
        reads: type | None = None,
        applies: Callable[[Any], bool] | None = None,
    ) -> Callable[[Callable], Callable]:
        """Decorator: register ``fn`` as a detector of this rule, of ``kind`` (see :data:`KINDS`). ``applies``:
        whether the input holds anything for it to check (a trainer, an adapter); when not, it is not run."""
        if kind not in KINDS:
            raise ValueError(f"{self.slug}: detector kind must be one of {list(KINDS)}")

        def register(fn: Callable) -> Callable:
            noted = _noting(self.slug, fn)
            self.detectors.append(Detector(self.slug, kind, noted, online, final, reads, applies))
            return noted

        return register

    def check(self, fn: Callable | None = None, *, applies: Callable[[Any], bool] | None = None):
        """Decorator: register ``fn(context)`` as this rule's preflight check (kind "context"); as
        ``@RULE.check(applies=...)`` with a predicate saying when the context holds anything to check."""
        register = self.detector("context", applies=applies)
        return register(fn) if fn is not None else register

    def finding(
        self,
        message: str,
        *,
        evidence: dict[str, Any] | None = None,
        fix: str | None = None,
        step: int | None = None,
        example: Any = None,
        severity: Severity | None = None,
        rows: Any = None,
        remedy: Any = None,
    ) -> Finding:
        """A finding of this rule; the fix defaults to the catalog's fix. ``rows``: every offending row, as a
        boolean mask over the rows or their indices; ``remedy``: its repair (``hf_sanity.remedies.Remedy``)."""
        if getattr(getattr(rows, "dtype", None), "kind", None) == "b":  # a numpy mask
            rows = rows.nonzero()[0]
        return Finding(
            rule=self.slug,
            severity=severity or self.severity,
            message=message,
            evidence=evidence or {},
            fix=fix or self.fix,
            step=step,
            example=example,
            rows=None if rows is None else sorted(int(i) for i in rows),
            remedy=remedy,
        )

    def explain(self) -> str:
        """The rule's text as Markdown: the same text the docs page and `hf-sanity explain` show."""
        return (
            f"## `{self.slug}`\n\n"
            f"*{self.severity}* · stage: {self.stage}\n\n"
            f"**Symptom.** {self.symptom}\n\n"
            f"**How it is detected.** {self.detects}\n\n"
            f"**Fix.** {self.fix}\n"
            + (
                f"\n**Remedy** ({self.remedy.safety}; `hf-sanity fix`). {self.remedy.does}\n"
                if self.remedy
                else ""
            )
            + f"\n**Objectives.** {_objectives_text(self.objectives)}\n"
            + (
                f"\n**Needs.** {', '.join(f'`{n}`' for n in self.needs)} to pass first.\n"
                if self.needs
                else ""
            )
        )


def _objectives_text(objectives: frozenset[str]) -> str:
    if objectives >= ANY - {"unknown"}:
        return "any training objective."
    return ", ".join(f"`{kind}`" for kind in OBJECTIVE_KINDS if kind in objectives) + "."


def _noting(slug: str, fn: Callable) -> Callable:
    """``fn`` as registered: each call that returns notes that the rule's detector ran (:func:`note_ran`),
    whoever calls it (the runner, or a test calling the detector on a hand-made input)."""
    import functools

    @functools.wraps(fn)
    def detector(*args, **kwargs):
        found = fn(*args, **kwargs)
        if _ran is not None or _ran_file is not None:
            note_ran((slug,))
        return found

    return detector


_RULES: dict[str, Rule] = {}
_MONITORS: list[type] = []


def define(
    slug: str,
    *,
    severity: Severity,
    stage: str,
    symptom: str,
    detects: str,
    fix: str,
    needs: tuple[str, ...] = (),
    explained_by: tuple[str, ...] = (),
    objectives: Iterable[str] = SFT,
    remedy: RemedyDoc | None = None,
) -> Rule:
    """Declare a rule. Each slug is declared exactly once. ``needs``: rules that must pass before this one
    can measure anything meaningful (:attr:`Rule.needs`); ``explained_by``: rules whose finding explains this
    one's symptom (:attr:`Rule.explained_by`); ``objectives``: the training objectives it is written for
    (:attr:`Rule.objectives`; SFT unless said); ``remedy``: what `hf-sanity fix` does about its findings."""
    if severity not in SEVERITIES:
        raise ValueError(f"{slug}: severity must be one of {SEVERITIES}")
    if stage not in STAGES:
        raise ValueError(f"{slug}: stage must be one of {list(STAGES)}")
    if slug in _RULES:
        raise ValueError(f"rule {slug!r} is declared twice ({_RULES[slug].module})")
    caller = sys._getframe(1).f_globals.get("__name__", "")  # inspect.stack() reads source: seconds
    rule = Rule(slug, severity, stage, symptom.strip(), detects.strip(), fix.strip(), module=caller)
    rule.needs, rule.explained_by = tuple(needs), tuple(explained_by)
    rule.objectives = frozenset(objectives)
    rule.remedy = remedy
    if not rule.objectives or not rule.objectives <= ANY:
        raise ValueError(f"{slug}: objectives must be among {OBJECTIVE_KINDS}, got {sorted(rule.objectives)}")
    _RULES[slug] = rule
    return rule


def monitor(cls: type) -> type:
    """Class decorator: register a Monitor (``cls.rules``, ``update(step, values) -> findings``) as the step
    detector of each of its rules. SanityCallback builds one of each registered monitor per run."""
    for rule in cls.rules:
        rule.detectors.append(Detector(rule.slug, "step", cls, online=True))
    _MONITORS.append(cls)
    return cls


_loaded = False


def rule_modules() -> list[str]:
    """Every module of the `hf_sanity.rules` package (and its subpackages)."""
    import hf_sanity.rules as package

    return sorted(
        info.name
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}.")
        if not info.ispkg
    )


def load() -> dict[str, Rule]:
    """Import every rule module (once) and return the catalog."""
    global _loaded
    if not _loaded:
        for name in rule_modules():
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
        hint = did_you_mean(slug, rules)
        listing = f"`hf-sanity rules` lists the {len(rules)} rules"
        raise UserInputError(f"unknown rule {slug!r}; " + (f"{hint} ({listing})" if hint else listing))
    return rules[slug]


SUGGESTIONS = 3  # close matches named for a mistyped slug


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """ "did you mean 'a' or 'b'?" for the names closest to ``word``, or "" when none is close: the names that
    contain it whole (a slug's stem, as `stop-token` of `stop-token-mismatch`) first, then difflib's closest
    (a typo)."""
    names = sorted(names)
    key = word.strip().lower()
    close = [n for n in names if key in n] if len(key) >= 3 else []
    close += [n for n in difflib.get_close_matches(key, names, n=SUGGESTIONS, cutoff=0.6) if n not in close]
    close = close[:SUGGESTIONS]
    if not close:
        return ""
    return "did you mean " + " or ".join(repr(n) for n in close) + "?"


def detectors(
    kind: str,
    *,
    stages: Iterable[str] | None = None,
    online: bool | None = None,
    enabled: Callable[[str], bool] | None = None,
) -> list[Detector]:
    """The detectors of ``kind``, in catalog order, filtered by their rule's stage, by ``online`` and by
    ``enabled(slug)`` (a selection, which also says the training objective)."""
    wanted = set(stages) if stages is not None else None
    return [
        d
        for rule in all_rules()
        if (wanted is None or rule.stage in wanted) and (enabled is None or enabled(rule.slug))
        for d in rule.detectors
        if d.kind == kind and (online is None or d.online == online)
    ]


def monitors(enabled: Callable[[str], bool] | None = None) -> list[type]:
    """The registered Monitor classes with at least one enabled rule."""
    load()
    return [cls for cls in _MONITORS if enabled is None or any(enabled(r.slug) for r in cls.rules)]


# -- running detectors -----------------------------------------------------------------------------
INTERNAL_ERROR = define(
    "internal-error",
    severity="warning",
    stage="internal",
    objectives=ANY,
    symptom="A check of hf-sanity raised an exception. Your run was not affected; the check was skipped.",
    detects="Every check runs inside a guard; an exception becomes this finding instead of reaching your code.",
    fix="Report it at the hf-sanity issue tracker with the evidence below; silence it with --ignore <slug>.",
)


def internal_error(check: str, exc: BaseException, step: int | None = None) -> Finding:
    """A broken check, as a finding: the run goes on."""
    tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
    return INTERNAL_ERROR.finding(
        f"check {check!r} failed with {type(exc).__name__}: {exc}",
        evidence={"check": check, "exception": type(exc).__name__, "traceback": "".join(tail).strip()},
        step=step,
    )


class Guard:
    """The one guard every check runs in: an exception inside becomes an ``internal-error`` finding appended
    to ``found`` and the caller goes on. Bad user input (:class:`UserInputError`) is not a broken check: it
    propagates, to become the one-line error of exit code 2, unless ``user_errors`` (inside a training run,
    nothing may escape into the user's loop). A plain class, not a generator: the callback enters one a dozen
    times a step."""

    __slots__ = ("check", "found", "step", "user_errors")

    def __init__(
        self, check: str, found: list[Finding] | None, *, step: int | None = None, user_errors: bool = False
    ) -> None:
        self.check, self.found, self.step, self.user_errors = check, found, step, user_errors

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is None or not issubclass(kind, Exception):
            return False
        if isinstance(exc, UserInputError) and not self.user_errors:
            return False
        self.broken(exc)
        return True

    def broken(self, exc: Exception) -> None:
        self.found.append(internal_error(self.check, exc, self.step))


guard = Guard


class NotMeasured(Exception):
    """Raised by a detector that cannot measure what it checks on this input (a custom ``nn.Module`` without
    ``get_input_embeddings``): not a broken check. The rule is reported once as not measured, with ``why``,
    and the checks that need it still run (nothing it measured failed)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# -- which detectors ran -----------------------------------------------------------------------------
# A clean test counts for a rule only where the rule's detector really ran (tests/conftest.py checks each
# @pytest.mark.clean against this). The runner notes every rule whose detector ran to its end on an input it
# applies to: into ``ran`` while a test records (:func:`recording`), and, for the processes a test starts (the
# CLI, torchrun's ranks), one line per rule into the file HF_SANITY_RECORD_RAN names. Off, as in every real
# run, a note is one test of two globals.
_ran: set[str] | None = None
_ran_file: str | None = os.environ.get("HF_SANITY_RECORD_RAN") or None
_ran_written: set[str] = set()


def note_ran(slugs: Iterable[str]) -> None:
    """Record that the detectors of ``slugs`` ran (see :func:`recording`)."""
    if _ran is None and _ran_file is None:
        return
    for slug in slugs:
        if _ran is not None:
            _ran.add(slug)
        if _ran_file is not None and slug not in _ran_written:
            _ran_written.add(slug)
            with open(_ran_file, "a", encoding="utf-8") as handle:
                handle.write(slug + "\n")


@contextlib.contextmanager
def recording():
    """``with recording() as ran:``: the slugs of the rules whose detectors ran inside the block (in this
    process; a subprocess records into the file named by the environment variable HF_SANITY_RECORD_RAN)."""
    global _ran
    outer, _ran = _ran, set()
    try:
        yield _ran
    finally:
        if outer is not None:
            outer |= _ran
        _ran = outer


def run(detector: Detector, subject: Any, *, step: int | None = None) -> list[Finding]:
    """One detector on what it reads, guarded (nothing when its ``applies`` says the input holds nothing for it);
    one that cannot measure this input says so (an info finding of ``checks-skipped``, merged by :func:`run_all`
    with the others skipped for the same reason)."""
    errors: list[Finding] = []
    with guard(detector.rule, errors, step=step):
        if detector.applies is not None and not detector.applies(subject):
            return []
        try:
            found = list(detector.fn(subject) or ())
            note_ran((detector.rule,))
            return found
        except NotMeasured as unmeasured:
            return [_not_measured([detector.rule], unmeasured.why, step)]
    return errors


def _not_measured(rules: list[str], why: str, step: int | None) -> Finding:
    return CHECKS_SKIPPED.finding(
        f"not measured: {', '.join(rules)}: {why}", evidence={"skipped": rules, "why": why}, step=step
    )


CHECKS_SKIPPED = define(
    "checks-skipped",
    severity="info",
    stage="internal",
    objectives=ANY,
    symptom="Some checks did not run: a problem they depend on was found first.",
    detects="A rule that needs another to pass (e.g. the step-0 loss needs every token id inside the embedding) "
    "is skipped when that rule finds an error on the same input; a rule that cannot measure this input (the "
    "embedding checks on a custom nn.Module without get_input_embeddings) is not measured, and the rules that "
    "need it still run. One finding per reason lists what was skipped or not measured, and why.",
    fix="Fix the problem the skipped checks depend on (its own finding is in this report), then run again; "
    "for checks not measured, the finding says what the model would need to expose.",
)
ALWAYS_REPORTED = frozenset({INTERNAL_ERROR.slug, CHECKS_SKIPPED.slug})


def run_all(
    kind: str,
    subject: Any,
    selection,
    *,
    stages: Iterable[str] | None = None,
    online: bool | None = None,
    step: int | None = None,
    show: str | None = None,
) -> list[Finding]:
    """Every enabled detector of ``kind`` on ``subject``, each guarded; findings as ``selection`` configures
    them (silenced rules dropped, severities overridden). Protocol detectors run only on the measurement
    type they read. ``show``: the name of the progress phase they run in (the rule running is shown with it).

    Preconditions first: a rule's ``needs`` run before it (measured even when not selected, reported only
    when selected; never one written for another training objective than the selection's); when one of them
    finds an error (or breaks), the rule is skipped and one ``checks-skipped`` finding says which checks were
    skipped and why."""
    rules = load()
    objective = getattr(selection, "objective", None)
    wanted = [d for d in detectors(kind, stages=stages, online=online) if selection.enabled(d.rule)]
    needed: set[str] = set()
    frontier = [n for d in wanted for n in rules[d.rule].needs]
    while frontier:  # preconditions of preconditions, too
        slug = frontier.pop()
        if slug not in needed and rules[slug].applies_to(objective):
            needed.add(slug)
            frontier.extend(rules[slug].needs)
    order = [d for slug in _dependency_order(needed) for d in rules[slug].detectors if d.kind == kind]
    order += [d for d in wanted if d.rule not in needed]
    skipped: dict[str, list[str]] = {}  # failed precondition -> the rules skipped for it
    with progress.phase(show, total=len(order)) if show else contextlib.nullcontext():
        out = _run_in_order(order, subject, selection, step, skipped)
    out = _merge_not_measured(out, step)
    for precondition, rules_skipped in skipped.items():
        names = sorted(set(rules_skipped))
        out.append(
            CHECKS_SKIPPED.finding(
                f"skipped {', '.join(names)}: {'they need' if len(names) > 1 else 'it needs'} {precondition} to "
                "pass first",
                evidence={"skipped": names, "needs": precondition},
                step=step,
            )
        )
    return out


def _run_in_order(order, subject, selection, step, skipped: dict[str, list[str]]) -> list[Finding]:
    rules = load()
    failed: set[str] = set()
    out: list[Finding] = []
    for detector in progress.each(order, detail=lambda d: d.rule):
        if detector.reads is not None and not isinstance(subject, detector.reads):
            continue
        applies, broken = _applies(detector, subject, step)
        if broken:  # its precondition broke: said once, and what needs this rule is skipped
            failed.add(detector.rule)
            out.extend(kept for kept in map(selection.apply, broken) if kept is not None)
        if not applies:
            continue
        blocking = [n for n in rules[detector.rule].needs if n in failed]
        if blocking:
            skipped.setdefault(blocking[0], []).append(detector.rule)
            failed.add(detector.rule)  # what needs a skipped rule cannot run either
            continue
        found = run(detector, subject, step=step)
        if any(f.severity == "error" or f.rule == INTERNAL_ERROR.slug for f in found):
            failed.add(detector.rule)
        unselected = not selection.enabled(detector.rule)  # a precondition, run for a rule that needs it
        for finding in found:
            if unselected and finding.rule == CHECKS_SKIPPED.slug and "why" in finding.evidence:
                continue  # not measured, but not asked for either
            if finding.rule in ALWAYS_REPORTED or selection.enabled(finding.rule):
                kept = selection.apply(finding)
                if kept is not None:
                    out.append(kept)
    return out


def _applies(detector: Detector, subject: Any, step: int | None) -> tuple[bool, list[Finding]]:
    """(whether ``detector`` has anything to check in ``subject``, the internal-error of an ``applies`` that
    raised): a broken ``applies`` is a broken check like any other, inside the guard, and skips only its rule."""
    if detector.applies is None:
        return True, []
    errors: list[Finding] = []
    with guard(detector.rule, errors, step=step):
        return bool(detector.applies(subject)), []
    return False, errors


def _merge_not_measured(findings: list[Finding], step: int | None) -> list[Finding]:
    """One ``checks-skipped`` finding per reason a rule was not measured, listing every rule it applies to, in
    the place of the first."""
    by_why: dict[str, list[str]] = {}
    for f in findings:
        if f.rule == CHECKS_SKIPPED.slug and "why" in f.evidence:
            by_why.setdefault(f.evidence["why"], []).extend(f.evidence["skipped"])
    out, said = [], set()
    for f in findings:
        why = f.evidence.get("why") if f.rule == CHECKS_SKIPPED.slug else None
        if why is None:
            out.append(f)
        elif why not in said:
            said.add(why)
            out.append(_not_measured(by_why[why], why, step))
    return out


def explained(finding: Finding, fired: Iterable[str]) -> bool:
    """Whether a rule in ``fired`` explains ``finding``'s symptom (see :attr:`Rule.explained_by`)."""
    rule = load().get(finding.rule)
    return rule is not None and any(slug in rule.explained_by for slug in fired)


def without_explained(findings: list[Finding]) -> list[Finding]:
    """``findings`` without those another of them explains."""
    fired = {f.rule for f in findings}
    return [f for f in findings if not explained(f, fired)]


def _dependency_order(slugs: set[str]) -> list[str]:
    """``slugs`` with every rule after the rules it needs (catalog order otherwise)."""
    rules = load()
    done: list[str] = []

    def visit(slug: str) -> None:
        if slug in done:
            return
        for need in rules[slug].needs:
            if need in slugs:
                visit(need)
        done.append(slug)

    for rule in all_rules():
        if rule.slug in slugs:
            visit(rule.slug)
    return done
