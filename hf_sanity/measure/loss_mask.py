"""Which tokens carry loss in the run being checked, and where that came from.

TRL 1.16's ``SFTTrainer`` decides it per dataset format (trl/trainer/sft_trainer.py): language-modelling rows
(conversational ``messages``, which it also makes of ShareGPT's ``conversations``, and ``text``) train on every
token unless ``assistant_only_loss=True``; prompt-completion rows train on the completion, since
``completion_only_loss=None`` resolves to True for them. Axolotl and LLaMA-Factory default to the assistant turns
(``--loss-on assistant``). The rules compare the labels against this (`prompt-in-loss`: the trainer's default,
or a mask asked for and not applied) and the report says it (``stats.loss_mask``, the header line, `show`).
"""

from __future__ import annotations

from dataclasses import dataclass

# What ``--loss-on`` / ``loss_on=`` accepts: completions only (TRL's completion_only_loss), the assistant turns
# (assistant_only_loss, the chat template's {% generation %} markers), or every token.
LOSS_ON = ("completion", "assistant", "all")
# Where a loss mask came from: the user's flag, the trainer's own config, TRL's default for the format, or
# labels the rows (or the trainer's collator) already carry.
SOURCES = ("flag", "trainer", "trl-default", "data")
MODES = (*LOSS_ON, "labels")  # "labels": as the rows' labels (or a collator's) say, token by token

# The formats TRL reads as language modelling (the loss on every token by default), once converted.
LANGUAGE_MODELLING = ("messages", "text")


@dataclass(frozen=True)
class LossMask:
    mode: str  # MODES
    source: str  # SOURCES
    why: str  # one sentence: what decided it

    @property
    def asked(self) -> bool:
        """The user asked for the prompt to stay out of the loss (a flag, or the trainer's config)."""
        return self.mode in ("completion", "assistant") and self.source in ("flag", "trainer")

    @property
    def intended_all(self) -> bool:
        """The user said every token carries loss (``--loss-on all``, ``completion_only_loss=False``)."""
        return self.mode == "all" and self.source in ("flag", "trainer")

    @property
    def trainer_default_all(self) -> bool:
        """Every token carries loss because that is the trainer's default, and nothing says it is intended."""
        return self.mode == "all" and self.source == "trl-default"

    def describe(self) -> dict[str, str]:
        """The report's ``stats.loss_mask``."""
        return {"mode": self.mode, "source": self.source, "why": self.why}

    def line(self) -> str:
        """The terminal header's line."""
        what = {
            "all": "every token",
            "completion": "the completions only",
            "assistant": "the assistant turns only",
            "labels": "the tokens the labels mark",
        }[self.mode]
        return f"loss mask: {what} ({self.source}; {self.why})"


def of_format(fmt: str, loss_on: str | None = None, *, has_labels: bool = False) -> LossMask:
    """The loss mask of rows of (read-as) format ``fmt`` under TRL's SFTTrainer, or as ``loss_on`` says."""
    if fmt == "tokens":  # pre-tokenized rows: their labels (TRL copies input_ids when there are none)
        if has_labels:
            return LossMask("labels", "data", "the rows carry their own labels column")
        return LossMask("all", "trl-default", "pre-tokenized rows without labels: TRL copies input_ids")
    if loss_on is not None:
        return LossMask(loss_on, "flag", f"--loss-on {loss_on}")
    if fmt == "messages":
        return LossMask(
            "all", "trl-default",
            "TRL's SFTTrainer trains on every token of conversational `messages` rows unless "
            "assistant_only_loss=True (Axolotl and LLaMA-Factory train the assistant turns: --loss-on assistant)",
        )  # fmt: skip
    if fmt == "text":
        return LossMask("all", "trl-default", "TRL's SFTTrainer trains on every token of `text` rows")
    return LossMask(
        "completion", "trl-default",
        "TRL's SFTTrainer trains on the completion of prompt-completion rows (completion_only_loss=None)",
    )  # fmt: skip


def of_trainer(trainer) -> LossMask:
    """The loss mask an ``SFTTrainer`` applies, from its config as TRL resolves it; the labels as they come
    for any other trainer, or an SFTTrainer given its own collator."""
    args = getattr(trainer, "args", None)
    collator = type(getattr(trainer, "data_collator", None))
    trl_collator = collator.__name__ == "DataCollatorForLanguageModeling" and collator.__module__.startswith(
        "trl"
    )
    if not _is_sft_trainer(trainer) or args is None:
        return LossMask("labels", "data", f"the labels of {type(trainer).__name__}'s batches")
    if not trl_collator:
        return LossMask("labels", "data", f"the labels the data collator ({collator.__name__}) makes")
    if getattr(args, "assistant_only_loss", False):
        return LossMask("assistant", "trainer", "SFTConfig(assistant_only_loss=True)")
    given = getattr(args, "completion_only_loss", None)
    resolved = getattr(trainer, "completion_only_loss", given)
    if resolved:
        if given is None:
            return LossMask(
                "completion",
                "trl-default",
                "prompt-completion data: completion_only_loss=None resolves to True",
            )
        return LossMask("completion", "trainer", "SFTConfig(completion_only_loss=True)")
    if given is False:
        return LossMask("all", "trainer", "SFTConfig(completion_only_loss=False)")
    return LossMask(
        "all", "trl-default",
        "TRL's SFTTrainer trains on every token of language-modelling rows (`messages`, `text`) unless "
        "assistant_only_loss=True",
    )  # fmt: skip


def _is_sft_trainer(trainer) -> bool:
    return any(cls.__name__ == "SFTTrainer" for cls in type(trainer).__mro__)
