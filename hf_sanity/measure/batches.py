"""Inspect the exact tensors a Trainer feeds its model: batches after the user's own collator.

Each batch row becomes one example (padding stripped by ``attention_mask``; packed rows split where
``position_ids`` restart), and the usual context is built over them, so every token rule applies to what
the model really sees.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.errors import UserInputError
from hf_sanity.measure import loss_mask
from hf_sanity.measure.context import Context
from hf_sanity.measure.encode import EncodeOptions
from hf_sanity.measure.processing import text_tokenizer
from hf_sanity.untouched import preserved_rng


def batch_rows(batch: Mapping[str, Any]) -> list[dict[str, list[int]]]:
    """Rows of one collated batch as ``{"input_ids", "labels"}`` lists, without padding."""
    input_ids = batch["input_ids"]
    labels = batch.get("labels")
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    rows = []
    for r in range(input_ids.shape[0]):
        ids = input_ids[r].tolist()
        labs = labels[r].tolist() if labels is not None else None
        keep = attended(mask, r) if mask is not None else [True] * len(ids)
        pos = positions[r].tolist() if positions is not None else None
        # Packed rows (padding-free): a new sequence starts wherever position_ids restart at 0.
        starts = [i for i, p in enumerate(pos) if p == 0] if pos is not None else [0]
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        bounds = [*starts, len(ids)]
        for lo, hi in itertools.pairwise(bounds):
            kept = [i for i in range(lo, hi) if keep[i]]
            if not kept:
                continue
            row = {"input_ids": [ids[i] for i in kept]}
            if labs is not None:
                row["labels"] = [labs[i] for i in kept]
            rows.append(row)
    return rows


def attended(mask, row: int) -> list[bool]:
    """Which positions of a batch row are tokens, by its attention mask: a 2-D padding mask's ones; a 4-D mask
    (batch, heads, query, key) built by the collator itself, the positions that may attend to themselves (its
    diagonal: True in a boolean mask, 0 in an additive float one)."""
    import torch

    if mask.dim() != 4:
        return mask[row].bool().tolist()
    diagonal = torch.diagonal(mask[row, 0], dim1=-2, dim2=-1)
    if diagonal.is_floating_point():
        return (diagonal > torch.finfo(diagonal.dtype).min / 2).tolist()
    return diagonal.bool().tolist()


def batches_context(
    tokenizer,
    batches: Iterable[Mapping[str, Any]],
    *,
    model=None,
    max_len=None,
    sample=256,
    trainer=None,
    first_batch=None,
    init_loss=None,
    rows_given: int | None = None,
    modality=None,
    refused_batches: list[str] | None = None,
    framework_cut: int | None = None,
) -> Context:
    """A context over already-collated batches (what the model sees), up to ``sample`` examples; where the
    ``trainer`` cut its rows is read from its arguments (``trainer_cuts``). With a vision-language
    ``modality``, each row's pictures are digested (`measure.vision.row_image_digests`)."""

    from hf_sanity.measure.vision import row_image_digests

    rows: list[dict[str, list[int]]] = []
    first_rows: list[dict[str, list[int]]] | None = None
    digests: list[str | None] | None = [] if modality is not None and modality.is_vision else None
    for batch in batches:
        batch_of = batch_rows(batch)
        first_rows = batch_of if first_rows is None else first_rows
        rows.extend(batch_of)
        if digests is not None:
            per_row = row_image_digests(batch, modality)
            # A row split by packing, or pictures not assigned to rows: no row of this batch is judged alike.
            if per_row is None or len(per_row) != len(batch_of):
                per_row = [f"unassigned-{len(digests) + i}" for i in range(len(batch_of))]
            digests.extend(per_row)
        if len(rows) >= sample:
            break
    rows = rows[:sample]
    if digests is not None:
        digests = digests[:sample]
    if rows and any("labels" not in r for r in rows):
        rows = [{"input_ids": r["input_ids"]} for r in rows]
    data = token_rows(rows)
    return Context(
        tokenizer=tokenizer,
        dataset=data,
        fmt="tokens",
        options=EncodeOptions(
            fmt="tokens", max_len=max_len, **trainer_cuts(trainer, first_rows, tokenizer, framework_cut)
        ),
        loss_mask=loss_mask.of_trainer(trainer) if trainer is not None else None,
        model=model,
        trainer=trainer,
        sample=sample,
        first_batch=first_batch,
        init_loss=init_loss,
        rows_given=rows_given,
        modality=modality,
        image_digests=digests,
        refused_batches=refused_batches or [],
    )


def token_rows(rows: list[dict[str, Any]]):
    """``rows`` (token lists, each with the same keys) as a Dataset, built straight from an Arrow table: what
    ``Dataset.from_list`` does, without hashing the rows for a fingerprint (~7 ms for one training batch)."""
    import uuid

    import datasets

    if not rows:
        return datasets.Dataset.from_dict({"input_ids": []})
    keys = rows[0].keys()
    if any(row.keys() != keys for row in rows):
        return datasets.Dataset.from_list(rows)
    import pyarrow as pa

    return datasets.Dataset(pa.Table.from_pylist(rows), fingerprint=uuid.uuid4().hex)


def trainer_max_len(trainer) -> int | None:
    """The length the trainer's framework cuts each row to, where its arguments say (`frameworks.configured_cut`)."""
    from hf_sanity.measure.frameworks import configured_cut

    return configured_cut(trainer)


# TRL's packing strategies that cut examples across rows: the rest of a cut example goes on in the next row
# ("wrapped" cuts the stream of examples into chunks; "bfd_split" splits the longer examples into pieces).
CUTTING_PACKINGS = ("wrapped", "bfd_split")


def trainer_cuts(
    trainer,
    first_rows: list[dict[str, list[int]]] | None = None,
    tokenizer=None,
    framework_cut: int | None = None,
) -> dict[str, Any]:
    """Where the trainer cut the rows hf-sanity sees (see ``EncodeOptions``): ``arrived_cut_at``, the length
    its framework truncates each example to, keeping its start (TRL's SFTTrainer without packing, or with
    packing "bfd", which truncates each example before packing it; Axolotl's `sequence_len`); where the
    arguments do not say (LLaMA-Factory's `cutoff_len`), ``framework_cut`` (what a framework's entry point
    read from its config), else read off ``first_rows``, the first batch's rows (`frameworks.batch_cut`);
    ``packed_cut_at``, the row length of a packing that cuts examples into pieces
    continued in the next row. Without a trainer (or its arguments): neither."""
    from hf_sanity.measure import frameworks

    args = getattr(trainer, "args", None)
    cuts: dict[str, Any] = {"arrived_cut_at": None, "packed_cut_at": None, "arrived_cut_source": None}
    if args is None or getattr(args, "truncation_mode", "keep_start") != "keep_start":
        return cuts
    configured = trainer_max_len(trainer)
    if getattr(args, "packing", False) and getattr(args, "packing_strategy", "bfd") in CUTTING_PACKINGS:
        cuts["packed_cut_at"] = configured
    elif configured:
        cuts["arrived_cut_at"], cuts["arrived_cut_source"] = configured, "arguments"
    elif framework_cut:
        cuts["arrived_cut_at"], cuts["arrived_cut_source"] = framework_cut, "config"
    elif (
        first_rows
        and frameworks.of_trainer(trainer).cuts_before_collator
        and not getattr(args, "packing", False)
    ):
        from hf_sanity.measure.encode import end_before_whitespace
        from hf_sanity.measure.markers import WhitespaceIds

        special = set(getattr(tokenizer, "all_special_ids", None) or ())
        blank = WhitespaceIds(tokenizer) if tokenizer is not None else frozenset()
        lengths = [len(r["input_ids"]) for r in first_rows]
        open_ends = [  # an answer trained to the row's last token, with no end of turn (glue after one is closed)
            bool(r.get("labels"))
            and r["labels"][-1] != IGNORE_INDEX
            and r["input_ids"][-1] not in special
            and end_before_whitespace(r["input_ids"], 0, len(r["input_ids"]) - 1, special, blank) is None
            for r in first_rows
        ]
        cut = frameworks.batch_cut(lengths, open_ends)
        if cut:
            cuts["arrived_cut_at"], cuts["arrived_cut_source"] = cut, "batch"
    return cuts


def trainer_tokenizer(trainer, tokenizer=None):
    """The tokenizer a trainer tokenizes with (a processor's own tokenizer)."""
    tokenizer = (
        tokenizer
        or getattr(trainer, "processing_class", None)
        or getattr(getattr(trainer, "data_collator", None), "tokenizer", None)
    )
    if tokenizer is None:
        raise UserInputError(
            "preflight(trainer=...) needs a tokenizer: pass processing_class= to the Trainer or tokenizer= to preflight"
        )
    return text_tokenizer(tokenizer)


def trainer_context(
    trainer,
    *,
    tokenizer=None,
    max_len: int | None = None,
    sample: int = 256,
    rows_given: int | None = None,
    objective=None,
    reward_dry_run: bool = True,
) -> Context:
    """The context of ``preflight(trainer=...)``: for SFT, the first batches of ``trainer.get_train_dataloader()``;
    for preference and RL trainers, what their own dataset preparation wrote (see :func:`objective_context`).

    Drawing batches must not change the run: RNG states are restored, and the dataloader is a fresh one.
    """
    tokenizer = trainer_tokenizer(trainer, tokenizer)
    if objective is not None and not objective.is_sft:
        return objective_context(
            trainer, objective, tokenizer=tokenizer, sample=sample, rows_given=rows_given,
            reward_dry_run=reward_dry_run,
        )  # fmt: skip
    from hf_sanity.measure.vision import measure_modality

    refused: list[str] = []  # a VLM collator's errors on the batches it refused (`image-span-truncated`)
    told = measure_modality(getattr(trainer, "processing_class", None), trainer.model)
    with preserved_rng():
        loader = iter(trainer.get_train_dataloader())
        if told.is_vision:
            drawn = iter(_vision_batches(trainer, loader, refused, sample))
            first = next(drawn, None)
        else:
            drawn, first = loader, next(loader, None)
        first = (
            dict(first) if first is not None else None
        )  # as the model receives it, non-tensor keys included

        def batches():
            if first is None:
                return
            for batch in itertools.chain([first], drawn):
                yield {k: v for k, v in batch.items() if hasattr(v, "shape")}

        modality = measure_modality(getattr(trainer, "processing_class", None), trainer.model, first)

        ctx = batches_context(
            tokenizer,
            batches(),
            model=trainer.model,
            max_len=max_len or trainer_max_len(trainer),
            sample=sample,
            trainer=trainer,
            first_batch=first,
            rows_given=rows_given,
            modality=modality,
            refused_batches=refused,
        )
        ctx.encoded  # noqa: B018 - materialise while the RNG is preserved
    return ctx


def _vision_batches(trainer, loader, refused: list[str], sample: int) -> list[dict]:
    """A VLM trainer's first batches (up to ``sample`` rows). Its collator may refuse a batch (the processor
    finds a row's image placeholders cut by max_length): the run would crash there, and the loader's iterator
    ends with that error. Then its dataset is collated in order, batch by batch, the refused batches skipped
    and their errors kept in ``refused`` (`image-span-truncated` says which rows)."""
    drawn: list[dict] = []
    rows = 0
    try:
        for batch in loader:
            drawn.append(dict(batch))
            rows += int(batch["input_ids"].shape[0])
            if rows >= sample:
                break
        return drawn
    except (ValueError, TypeError) as exc:  # Idefics3's processor fails with a TypeError on a cut span
        if not getattr(trainer.data_collator, "max_length", None):
            raise  # no cut: not a placeholder run max_length cut, the user's error to see
        refused.append(_first_line(exc))
    data, collator = trainer.train_dataset, trainer.data_collator
    size = int(trainer.args.per_device_train_batch_size)
    drawn, rows, refused[:] = [], 0, []
    for start in range(0, len(data), size):
        try:
            batch = collator([dict(data[i]) for i in range(start, min(start + size, len(data)))])
        except (ValueError, TypeError) as exc:
            refused.append(_first_line(exc))
            continue
        drawn.append(dict(batch))
        rows += int(batch["input_ids"].shape[0])
        if rows >= sample:
            break
    return drawn


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def objective_context(
    trainer,
    objective,
    *,
    tokenizer,
    sample: int = 256,
    rows_given: int | None = None,
    reward_dry_run: bool = True,
) -> Context:
    """The context of a preference, reward or RL trainer: the pairs (or KTO's rows) its dataset preparation
    wrote, cut as its collator cuts them, with each pair's chosen side as the context's rows; for RL (and a
    trainer of unknown objective), its prompts rendered as it renders them, and for RL its rollouts
    (`measure.rl.Rollouts`: ``reward_dry_run=False`` calls no reward function)."""
    import datasets

    from hf_sanity.measure import preference
    from hf_sanity.measure.markers import derive_markers

    markers = derive_markers(tokenizer)
    pairs = unpaired = rollouts = None
    max_len = getattr(trainer.args, "max_length", None)
    if objective.kind in ("preference", "reward"):
        pairs, rows = preference.pairs_from_trainer(
            trainer, tokenizer=tokenizer, markers=markers, reward=objective.kind == "reward", sample=sample
        )
    elif objective.kind == "preference-unpaired":
        unpaired, rows = preference.unpaired_from_trainer(trainer)
    else:
        rows, max_len = prompt_rows(trainer, tokenizer, sample), None
        if objective.kind == "rl":
            from hf_sanity.measure.rl import Rollouts

            rollouts = Rollouts(trainer, reward_dry_run=reward_dry_run)
    data = datasets.Dataset.from_list(rows) if rows else datasets.Dataset.from_dict({"input_ids": []})
    return Context(
        tokenizer=tokenizer, dataset=data, fmt="tokens", options=EncodeOptions(fmt="tokens", max_len=max_len),
        model=trainer.model, trainer=trainer, sample=sample, rows_given=rows_given, objective=objective,
        pairs=pairs, unpaired=unpaired, rl=rollouts, prompts=getattr(trainer, "train_dataset", None),
    )  # fmt: skip


def prompt_rows(trainer, tokenizer, sample: int) -> list[dict[str, list[int]]]:
    """An RL trainer's first prompts as it renders them for generation (no completion: no labels)."""
    return rendered_prompts(getattr(trainer, "train_dataset", None), tokenizer, sample)


def rendered_prompts(data, tokenizer, sample: int) -> list[dict[str, list[int]]]:
    """The first ``sample`` prompts of ``data`` (a dataset with a `prompt` column) as TRL's GRPOTrainer renders
    them for generation: conversational ones through the chat template with the generation prompt, text ones
    tokenized with special tokens."""
    from hf_sanity.measure.formats import is_conversational

    if data is None or "prompt" not in getattr(data, "column_names", ()):
        return []
    rows = []
    for prompt in data.select(range(min(sample, len(data))))["prompt"]:
        if is_conversational(prompt):
            ids = tokenizer.apply_chat_template(
                prompt, tokenize=True, return_dict=True, add_generation_prompt=True
            )
            rows.append({"input_ids": list(ids["input_ids"])})
        elif isinstance(prompt, str):
            rows.append({"input_ids": list(tokenizer(prompt)["input_ids"])})
    return rows


def prompts_context(
    tokenizer, dataset, *, objective, max_len: int | None = None, sample: int = 256, **model_side
) -> Context:
    """The context of a prompt-only file (TRL's "prompt-only" type: GRPO and RLOO data) without a trainer: its
    prompts rendered as the RL trainer renders them, read as the RL objective. No trainer: no generation and no
    reward function (the rules that read the rollouts need ``trainer=``). ``max_len``: the prompt budget the
    length rules compare the prompts with."""
    import datasets

    rows = rendered_prompts(dataset, tokenizer, sample)
    data = datasets.Dataset.from_list(rows) if rows else datasets.Dataset.from_dict({"input_ids": []})
    return Context(
        tokenizer=tokenizer, dataset=data, fmt="tokens", options=EncodeOptions(fmt="tokens", max_len=max_len),
        sample=sample, rows_given=len(dataset), objective=objective, prompts=dataset, **model_side,
    )  # fmt: skip
