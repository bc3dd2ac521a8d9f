"""`show()`: the exact tensors the model will be fed, decoded (the protocol's "print the exact tensor entering the
model and decode it"; Axolotl's ``preprocess --debug``, with the labels' shift, padding and packing marked).

Three sources, the closest to what the model really gets first:

* ``trainer=``: the trainer's own batches, after its collator: the first batch of
  ``trainer.get_train_dataloader()`` (RNG states kept: the run draws the same batches), or with ``rows`` those
  rows of its train dataset collated together (its collator, in order);
* ``trainer_batch=True`` (`hf-sanity show --trainer-batch`): a TRL ``SFTTrainer`` built on the model and the
  dataset's ``rows`` with TRL's defaults (``max_length``), and its batch;
* else: the ``rows`` tokenized as TRL's SFTTrainer tokenizes them (the measurement core's encoder: the chat
  template; labels on every token of ``messages`` and ``text`` rows, on the completion of prompt-completion
  rows, unless ``loss_on`` says otherwise) and right-padded into one batch as its collator pads them (labels -100
  and attention 0 on the padding).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

from hf_sanity.batchview import BatchView
from hf_sanity.errors import UserInputError
from hf_sanity.measure.loss_mask import LOSS_ON, of_format
from hf_sanity.report import Report

DEFAULT_ROWS = (0, 1)


def parse_rows(text: str | Sequence[int] | None) -> list[int] | None:
    """``"0,5"`` (or ``"0-3"``, or a list of ints) as row indices; None for None."""
    if text is None:
        return None
    if not isinstance(text, str):
        rows = [int(r) for r in text]
    else:
        rows = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                lo, _, hi = part.partition("-")
                rows += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
            except ValueError:
                raise UserInputError(f"--rows takes row numbers like 0,5 or 0-3, got {text!r}") from None
    if not rows or min(rows) < 0:
        raise UserInputError(f"--rows takes row numbers (0 or more) like 0,5 or 0-3, got {text!r}")
    return list(dict.fromkeys(rows))


def show(
    model=None,
    tokenizer=None,
    dataset=None,
    *,
    trainer=None,
    rows: str | Sequence[int] | None = None,
    trainer_batch: bool = False,
    max_len: int | None = None,
    loss_on: str | None = None,
    format: str | None = None,
    alpaca_template: str | None = None,
    source: str = "the dataset",
) -> Report:
    """The decoded batch as a :class:`Report` whose one view is a :class:`~hf_sanity.batchview.BatchView`
    (``report.print()``, ``write_json``, ``write_html``); no checks run (`preflight` runs them)."""
    picked = parse_rows(rows)
    if trainer is not None:
        view = trainer_view(trainer, picked)
    elif trainer_batch:
        view = sft_trainer_view(
            model, tokenizer, dataset, picked or list(DEFAULT_ROWS), max_len=max_len, source=source
        )
    else:
        if tokenizer is None or dataset is None:
            raise UserInputError("show needs a tokenizer and a dataset (or trainer=...)")
        from hf_sanity.measure.formats import COLUMNS, PREFERENCE_FORMATS, detect_format
        from hf_sanity.measure.objective import of_columns
        from hf_sanity.measure.sources import as_dataset

        dataset = as_dataset(dataset)
        fmt = detect_format(dataset.column_names, format, features=dataset.features)
        if fmt in PREFERENCE_FORMATS:
            objective = of_columns(COLUMNS[fmt]).kind
            view = preference_view(tokenizer, dataset, picked or list(DEFAULT_ROWS), objective=objective,
                                   max_len=max_len, source=source)  # fmt: skip
            return _report(view)
        view = encoded_view(
            tokenizer, dataset, picked or list(DEFAULT_ROWS), max_len=max_len, loss_on=loss_on, format=format,
            alpaca_template=alpaca_template, source=source,
        )  # fmt: skip
    return _report(view)


def _report(view: BatchView) -> Report:
    count = len(view.summaries)
    said = f"{count} row{'s' if count != 1 else ''} as the model is fed them (no checks run: preflight runs them)"
    stats = {"loss_mask": view.loss_mask} if view.loss_mask else {}
    return Report(title="hf-sanity show", views=[view], headline=said, stats=stats)


def preference_view(
    tokenizer,
    dataset,
    rows: list[int],
    *,
    objective: str,
    max_len: int | None = None,
    source: str = "the dataset",
) -> BatchView:
    """Preference rows as TRL 1.16 feeds them: each pair's chosen and rejected sequences (prompt, then the
    completion carrying the loss), cut at ``max_len`` (TRL's default 1024), in one batch, every chosen side
    then every rejected side as its concatenated forward takes them; KTO rows one sequence each."""
    from hf_sanity.measure.preference import DEFAULT_MAX_LENGTH, cut, tokenize_pair
    from hf_sanity.measure.tensors import pad_batches, pad_id

    beyond = [r for r in rows if r >= len(dataset)]
    if beyond:
        raise UserInputError(f"--rows {beyond[0]} is past the end of {source} ({len(dataset)} rows)")
    max_len = DEFAULT_MAX_LENGTH if max_len is None else max_len
    sides: dict[str, list] = {"chosen": [], "rejected": []}
    names: dict[str, list] = {"chosen": [], "rejected": []}
    for r in rows:
        row = dataset[r]
        if objective == "preference-unpaired":
            row = {**row, "chosen": row["completion"], "rejected": row["completion"]}
        prompt, chosen, rejected, _ = tokenize_pair(tokenizer, row, reward=objective == "reward")
        for side, completion in (("chosen", chosen), ("rejected", rejected)):
            if objective == "preference-unpaired" and side == "rejected":
                continue
            ids = cut(prompt, completion, max_len, "keep_start")
            labels = ([-100] * len(prompt) + list(completion))[: len(ids)]
            sides[side].append((ids, labels))
            label = f" ({'desirable' if row.get('label') else 'undesirable'})" if "label" in row else ""
            names[side].append(
                f"row {r}{label}" if objective == "preference-unpaired" else f"pair {r} {side}"
            )
    [batch] = pad_batches(sides["chosen"] + sides["rejected"], pad_id(tokenizer))
    fed = (
        "one sequence per row"
        if objective == "preference-unpaired"
        else "every chosen side, then every rejected side"
    )
    what = (
        f"{_listed(rows)} of {source} ({objective} data), tokenized as TRL's trainer for it does "
        f"(the prompt with the generation prompt, the completion after it, cut at max_length={max_len}), in one "
        f"right-padded batch: {fed}"
    )
    return BatchView.from_batch(tokenizer, batch, source=what, names=names["chosen"] + names["rejected"])


def encoded_view(
    tokenizer, dataset, rows: list[int], *, max_len=None, loss_on=None, format=None, alpaca_template=None,
    source: str = "the dataset",
) -> BatchView:  # fmt: skip
    """``rows`` of ``dataset`` tokenized as TRL does, cut at ``max_len`` and right-padded into one batch."""
    from hf_sanity.measure.encode import EncodeOptions, Encoder
    from hf_sanity.measure.formats import detect_format
    from hf_sanity.measure.sources import as_dataset
    from hf_sanity.measure.tensors import pad_batches, pad_id

    if loss_on is not None and loss_on not in LOSS_ON:
        raise UserInputError(f"--loss-on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    if max_len is not None and max_len <= 0:
        raise UserInputError(f"--max-len must be positive, got {max_len}")
    dataset = as_dataset(dataset)
    beyond = [r for r in rows if r >= len(dataset)]
    if beyond:
        raise UserInputError(f"--rows {beyond[0]} is past the end of {source} ({len(dataset)} rows)")
    fmt = detect_format(dataset.column_names, format, features=dataset.features)
    encoder = Encoder(
        tokenizer, EncodeOptions(fmt=fmt, loss_on=loss_on, max_len=max_len, alpaca_template=alpaca_template)
    )
    seqs = []
    for r in rows:
        encoded = encoder.encode(dataset[r])
        if encoded["error"]:
            raise UserInputError(f"row {r} of {source} cannot be tokenized: {encoded['error']}")
        seqs.append((encoded["input_ids"][:max_len], encoded["labels"][:max_len]))
    [batch] = pad_batches(seqs, pad_id(tokenizer))
    cut = f", cut at max_len={max_len}" if max_len else ""
    has_labels = "labels" in dataset.column_names
    mask = encoder.loss_mask if encoder.fmt != "tokens" else of_format("tokens", has_labels=has_labels)
    what = (
        f"{_listed(rows)} of {source}, tokenized as TRL's SFTTrainer tokenizes {fmt} rows ({mask.line()}{cut}) "
        "and right-padded into one batch as its collator pads (labels -100 and attention 0 on the padding)"
    )
    view = BatchView.from_batch(tokenizer, batch, source=what, names=[f"dataset row {r}" for r in rows])
    view.loss_mask = mask.describe()
    return view


def trainer_view(trainer, rows: list[int] | None, names: list[str] | None = None) -> BatchView:
    """The trainer's first batch (``rows`` None) or ``rows`` of its train dataset, collated by its collator."""
    from hf_sanity.measure.batches import trainer_tokenizer
    from hf_sanity.untouched import preserved_rng

    tokenizer = trainer_tokenizer(trainer)
    collator = type(getattr(trainer, "data_collator", None)).__name__
    with preserved_rng():
        if rows is None:
            batch = next(iter(trainer.get_train_dataloader()), None)
            what = f"the first batch of trainer.get_train_dataloader(), after its collator ({collator})"
        else:
            data = trainer.train_dataset
            beyond = [r for r in rows if r >= len(data)]
            if beyond:
                raise UserInputError(
                    f"row {beyond[0]} is past the end of the trainer's train dataset ({len(data)} rows)"
                )
            batch = _collated(trainer, data, rows)
            what = (
                f"{_listed(rows)} of the trainer's train dataset (as its dataset preparation left "
                f"them), collated together by its collator ({collator})"
            )
    if batch is None or not hasattr(batch.get("input_ids"), "shape"):
        raise UserInputError("the trainer's batches have no input_ids tensor to show")
    tensors = {k: v.detach().cpu() for k, v in batch.items() if hasattr(v, "shape")}
    return BatchView.from_batch(
        tokenizer, tensors, source=what, names=names or _row_names(trainer, tensors, rows)
    )


def _row_names(trainer, tensors: dict[str, Any], rows: list[int] | None) -> list[str]:
    """What each row of a trainer's batch is: a pair's chosen or rejected side (a DPO-family or reward trainer
    feeds every chosen side, then every rejected side), a KTO row and its label, or a row of its dataset."""
    from hf_sanity.measure.objective import of_trainer

    count = int(tensors["input_ids"].shape[0])
    kind = of_trainer(trainer).kind
    indices = rows if rows is not None else None
    if kind in ("preference", "reward") and count % 2 == 0:
        pairs = indices if indices is not None and len(indices) == count // 2 else range(count // 2)
        where = "pair" if indices is not None else "batch pair"
        return [f"{where} {p} {side}" for side in ("chosen", "rejected") for p in pairs]
    if kind == "preference-unpaired" and "label" in tensors:
        labels = ["desirable" if bool(v) else "undesirable" for v in tensors["label"].tolist()]
        return [f"row {indices[i] if indices else i} ({label})" for i, label in enumerate(labels)]
    if indices is not None:
        return [f"train dataset row {r}" for r in indices]
    return [f"row {i}" for i in range(count)]


def _collated(trainer, data, rows: list[int]) -> dict[str, Any]:
    """``rows`` of ``data`` through what the trainer's dataloader does to a batch: the columns its model does not
    take removed (``remove_unused_columns``), then its collator."""
    collate = trainer.data_collator
    if hasattr(data, "select") and hasattr(trainer, "_remove_unused_columns"):
        subset = trainer._remove_unused_columns(data.select(rows), description="Training")
        examples = [subset[i] for i in range(len(subset))]
    else:
        examples = [data[r] for r in rows]
        if hasattr(trainer, "_get_collator_with_removed_columns"):
            collate = trainer._get_collator_with_removed_columns(collate, description="Training")
    return collate(examples)


def sft_trainer_view(
    model, tokenizer, dataset, rows: list[int], *, max_len=None, source="the dataset"
) -> BatchView:
    """``rows`` of ``dataset`` as TRL's SFTTrainer prepares and collates them, with TRL's defaults."""
    try:
        from trl import SFTConfig, SFTTrainer
    except ImportError:
        raise UserInputError(
            "--trainer-batch builds TRL's SFTTrainer: install trl (pip install trl)"
        ) from None
    from hf_sanity.measure.sources import as_dataset

    dataset = as_dataset(dataset)
    beyond = [r for r in rows if r >= len(dataset)]
    if beyond:
        raise UserInputError(f"--rows {beyond[0]} is past the end of {source} ({len(dataset)} rows)")
    model = model() if callable(model) and not hasattr(model, "forward") else model
    if model is None:
        raise UserInputError("--trainer-batch needs the model: TRL's SFTTrainer is built on it")
    folder = tempfile.mkdtemp(prefix="hf-sanity-show-")
    try:
        settings = dict(output_dir=folder, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                        per_device_train_batch_size=len(rows), dataset_num_proc=None)  # fmt: skip
        if max_len is not None:
            settings["max_length"] = max_len
        with _quiet():
            trainer = SFTTrainer(model=model, args=SFTConfig(**settings), train_dataset=dataset.select(rows),
                                 processing_class=tokenizer)  # fmt: skip
        kept = len(trainer.train_dataset)
        names = [f"dataset row {r}" for r in rows] if kept == len(rows) else None
        view = trainer_view(trainer, list(range(kept)), names=names)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    dropped = f" ({len(rows) - kept} of them dropped by TRL)" if kept < len(rows) else ""
    view.source = (
        f"{_listed(rows)} of {source}{dropped}, prepared and collated by TRL's SFTTrainer with its "
        f"defaults (max_length={trainer.args.max_length}, collator {type(trainer.data_collator).__name__})"
    )
    return view


@contextlib.contextmanager
def _quiet():
    """TRL's dataset preparation without its progress bars and deprecation warnings: the view is the output."""
    import datasets

    shown = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(None):
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def _listed(rows: list[int]) -> str:
    return f"row{'s' if len(rows) != 1 else ''} {', '.join(map(str, rows))}"


def shown_rows(ctx, count: int, dataset=None) -> BatchView | None:
    """`preflight --show N`: the first ``count`` rows the checks read, as the model gets them: the trainer's first
    batch with ``trainer=``, else the first encoded rows right-padded into one batch (preference data: the
    first pairs' chosen and rejected sides, from ``dataset``, the rows as given)."""
    from hf_sanity.measure.tensors import pad_batches, pad_id

    if ctx.trainer is not None and ctx.first_batch is None:  # a preference or RL trainer: its own first batch
        return trainer_view(ctx.trainer, None)
    if ctx.pairs is not None or ctx.unpaired is not None:
        if dataset is None:
            return None
        rows = list(range(min(count, len(dataset))))
        return preference_view(
            ctx.tokenizer, dataset, rows, objective=ctx.objective.kind, max_len=ctx.options.max_len
        )
    if ctx.first_batch is not None:
        tensors = {k: v.detach().cpu() for k, v in ctx.first_batch.items() if hasattr(v, "shape")}
        rows = list(range(min(count, int(tensors["input_ids"].shape[0]))))
        return BatchView.from_batch(
            ctx.tokenizer, tensors, rows=rows,
            source="the first batch of trainer.get_train_dataloader(), after its collator",
        )  # fmt: skip
    valid = [int(i) for i in ctx.first(ctx.valid, count)]
    if not valid:
        return None
    cut = ctx.options.max_len
    seqs = [(ctx.row(i)["input_ids"][:cut], ctx.row(i)["labels"][:cut]) for i in valid]
    [batch] = pad_batches(seqs, pad_id(ctx.tokenizer))
    source = (
        f"{_listed(valid)} of the dataset as the checks read them (tokenized as TRL's SFTTrainer "
        f"does; {ctx.loss_mask.line()}), right-padded into one batch as its collator pads"
    )
    view = BatchView.from_batch(
        ctx.tokenizer, batch, source=source, names=[f"dataset row {r}" for r in valid]
    )
    view.loss_mask = ctx.loss_mask.describe()
    return view
