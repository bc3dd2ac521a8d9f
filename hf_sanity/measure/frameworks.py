"""The framework that built a trainer (TRL, Axolotl, LLaMA-Factory, or transformers' own `Trainer` in the
user's script), what its settings are called, and where it cut the rows the model sees.

Findings whose fix is a setting say it in the framework's terms (LLaMA-Factory's `cutoff_len`, Axolotl's
`sequence_len`, TRL's `max_length`), and the report names the trainer it read (``stats.trainer``). Each framework
prepares its rows before the collator, so the cut is read where the framework keeps it: TRL's and Axolotl's
training arguments; LLaMA-Factory keeps `cutoff_len` in its data arguments, which its trainer never sees, so
there the cut is read off the batch: rows of one length with answers that end without their end of turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Framework:
    name: str  # as its users call it
    cut_key: str  # the setting that cuts every row to a length (the rules say the rest in its terms)
    cuts_before_collator: bool = True  # rows arrive cut (else the user's own tokenization decides)
    # The trainer's dataset is the table its own preparation filtered (TRL's SFTTrainer drops the rows its cut left
    # without a completion token). Axolotl filters, splits and shuffles its rows before its trainer exists: the
    # rows its trainer's dataset lacks are not the trainer's drops (see PreparedDrop).
    trainer_drops: bool = True


TRL = Framework("TRL", "max_length")
AXOLOTL = Framework("Axolotl", "sequence_len", trainer_drops=False)
LLAMA_FACTORY = Framework("LLaMA-Factory", "cutoff_len")
TRANSFORMERS = Framework("transformers", "max_length", cuts_before_collator=False)  # the user's own arguments
# By the top package of a class in the trainer's MRO, the most specific first (Axolotl's trainers subclass TRL's).
BY_PACKAGE = {"llamafactory": LLAMA_FACTORY, "axolotl": AXOLOTL, "trl": TRL}


def of_trainer(trainer) -> Framework:
    """The framework whose trainer class ``trainer`` is (or subclasses)."""
    packages = [cls.__module__.split(".")[0] for cls in type(trainer).__mro__]
    for package, framework in BY_PACKAGE.items():
        if package in packages:
            return framework
    return TRANSFORMERS


def trainer_facts(trainer) -> dict[str, Any]:
    """``stats.trainer``: the trainer's class and module, its framework and, where its arguments say it, the length
    the framework cuts each row to."""
    cls = type(trainer)
    facts: dict[str, Any] = {
        "class": cls.__name__,
        "module": cls.__module__,
        "framework": of_trainer(trainer).name,
    }
    length = configured_cut(trainer)
    if length:
        facts["cut_length"] = length
    return facts


def configured_cut(trainer) -> int | None:
    """The length the framework cuts each row to, from the trainer's arguments: TRL's `max_length` (older
    `max_seq_length`), Axolotl's `sequence_len`; None where the trainer does not know it (LLaMA-Factory, a
    plain Trainer over the user's own tokenization)."""
    args = getattr(trainer, "args", None)
    for key in ("max_length", "max_seq_length", "sequence_len"):
        value = getattr(args, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def batch_cut(lengths: Sequence[int], ends_open: Sequence[bool]) -> int | None:
    """The cut a framework made before the collator, read off a batch: every row (two at least) as long as the
    longest and at least one of them with an answer running to its last token without an end of turn. Rows of
    natural lengths are never all equal; rows packed to one length are not read here (their pieces go on in the
    next row)."""
    if len(lengths) < 2 or len(set(lengths)) != 1 or not any(ends_open):
        return None
    return lengths[0]


@dataclass(frozen=True)
class PreparedDrop:
    """Rows a framework's data preparation dropped for being longer than its cut, before its trainer existed
    (Axolotl's `excess_length_strategy: drop`, its default): counted in the process that prepared them, by the
    framework's integration (:mod:`hf_sanity.integrations.axolotl`), since the trainer never sees them."""

    framework: str
    rows_prepared: int  # the rows the preparation tokenized, before it dropped any
    rows_kept: int
    too_long: int  # of the dropped rows, those longer than the cut
    cut: int  # the length (Axolotl's `sequence_len`)
    strategy: str  # what the framework does with a longer row ("drop")
    strategy_set: bool  # the user's config set it (else it is the framework's default)
    longest: int | None = None  # the longest row dropped, in tokens
    # Counted when the framework prepared the rows this run loaded from its cache (Axolotl's
    # `dataset_prepared_path`: an earlier run, or `axolotl preprocess`), not in this process.
    prepared_earlier: bool = False

    @property
    def other_dropped(self) -> int:
        """Rows dropped for something else in the same pass (Axolotl also drops rows under `min_sample_len`)."""
        return max(0, self.rows_prepared - self.rows_kept - self.too_long)


_prepared_drops: dict[str, PreparedDrop] = {}  # by framework name: this process's training split


def record_prepared_drop(drop: PreparedDrop) -> None:
    """What a framework's preparation of the training rows dropped in this process (the latest wins)."""
    _prepared_drops[drop.framework] = drop


def prepared_drop(framework: Framework) -> PreparedDrop | None:
    """The rows ``framework``'s preparation dropped for length in this process, or None (not counted: prepared
    elsewhere, loaded from its cache, or nothing dropped)."""
    return _prepared_drops.get(framework.name)


def forget_prepared_drops(framework: Framework | None = None) -> None:
    """No count for ``framework`` (every framework's when None): its rows were prepared again, uncounted."""
    if framework is None:
        _prepared_drops.clear()
    else:
        _prepared_drops.pop(framework.name, None)
