"""`preflight()`: load -> one shared context -> every selected context detector -> one report."""

from __future__ import annotations

import time
from collections.abc import Iterable

from hf_sanity import catalog, versions
from hf_sanity.errors import UserInputError
from hf_sanity.measure.context import Context
from hf_sanity.measure.encode import EncodeOptions
from hf_sanity.measure.formats import (
    COLUMNS,
    PREFERENCE_FORMATS,
    RL_FORMATS,
    check_alpaca_template,
    detect_format,
    string_label_note,
)
from hf_sanity.measure.loss_mask import LOSS_ON
from hf_sanity.measure.objective import Objective, of_columns, of_trainer
from hf_sanity.measure.sources import as_dataset
from hf_sanity.report import Report
from hf_sanity.selection import Selection, resolve

PREFLIGHT_STAGES = ("data", "tokens", "template", "model", "trainer")
# What the completions are: written by the model (generative), or quoted from the prompt (extractive QA, RAG
# with citations), where the answer appearing in the prompt is the point (label-leakage is off).
TASKS = ("generative", "extractive")


def run_checks(
    ctx, selection: Selection, stages: Iterable[str] = PREFLIGHT_STAGES, report: Report | None = None
) -> Report:
    """Every enabled context detector of ``stages`` on ``ctx``, each in the catalog's guard."""
    report = report or Report(title="hf-sanity preflight")
    report.extend(catalog.run_all("context", ctx, selection, stages=stages, show="running checks"))
    return report


def preflight(
    model=None,
    tokenizer=None,
    dataset=None,
    *,
    trainer=None,
    eval_dataset=None,
    max_len: int | None = None,
    loss_on: str | None = None,
    format: str | None = None,
    alpaca_template: str | None = None,
    task: str = "generative",
    adapter: str | None = None,
    inference_tokenizer=None,
    sample: int = 256,
    num_proc: int | None = None,
    model_config=None,
    generation_config=None,
    reward_dry_run: bool = True,
    select: str | Iterable[str] | None = None,
    ignore: str | Iterable[str] | None = None,
    use_config: bool = True,
    show: int | None = None,
) -> Report:
    """Inspect a fine-tuning setup before any training step and return a :class:`Report`.

    Pass ``model``/``tokenizer``/``dataset`` (objects; the CLI loads them from paths), or ``trainer=`` to
    inspect the exact batches of ``trainer.get_train_dataloader()`` after the trainer's own collator (with
    ``dataset=``, the dataset given to the trainer: the rows it dropped are counted against it).
    ``model`` may be a callable returning the model, so it is loaded only if a model rule needs it;
    ``generation_config`` is how it will be served (the model object's own when not given).
    ``loss_on``: which tokens carry loss, ``completion``, ``assistant`` or ``all`` (default: what TRL's
    SFTTrainer does with the format: every token of ``messages`` and ``text`` rows, the completion of
    prompt-completion rows; ``stats.loss_mask`` says which and why; with ``trainer=``, the trainer's own).
    ``format``: the dataset format (default: detected from the columns; ShareGPT and Alpaca rows are read as
    the tools that use them build them); ``alpaca_template``: ``chat`` or ``text`` for Alpaca rows (default:
    chat when the tokenizer has a chat template); ``task``: ``extractive`` when the answers quote the prompt
    (extractive QA, RAG with citations). ``reward_dry_run``: with an RL trainer (GRPO, RLOO), call its reward
    functions on a few completions before training (on copies, with a time limit); False when they call a paid
    or remote service (the report says they were not called). ``show``: also show the first ``show`` rows decoded as the model
    is fed them (``report.views``: `hf_sanity.batchview`; with ``trainer=``, its first batch).
    """
    selection = resolve(select, ignore, use_config=use_config)
    started = time.perf_counter()
    load_seconds: list[float] = []  # the model loader's, if it runs
    if eval_dataset is not None:
        eval_dataset = as_dataset(eval_dataset, "eval_dataset")
    if trainer is not None:
        from hf_sanity.measure.batches import trainer_context

        objective = of_trainer(trainer)
        rows_given = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
        ctx = trainer_context(
            trainer, tokenizer=tokenizer, max_len=max_len, sample=sample, rows_given=rows_given,
            objective=objective, reward_dry_run=reward_dry_run,
        )  # fmt: skip
    else:
        if tokenizer is None or dataset is None:
            raise UserInputError("preflight needs a tokenizer and a dataset (or trainer=...)")
        check_options(
            loss_on=loss_on, max_len=max_len, sample=sample, alpaca_template=alpaca_template, task=task
        )
        dataset = as_dataset(dataset)
        fmt = detect_format(dataset.column_names, format, features=dataset.features)
        label_note = None if format else string_label_note(dataset.column_names, dataset.features)
        # `model` may be a function that loads the model, so that only a model rule pays for loading it.
        is_loader = callable(model) and not hasattr(model, "forward")
        if is_loader:  # timed, for the report's split of the wall time
            model = _timed(model, load_seconds)
        model_side = dict(
            model=None if is_loader else model, model_loader=model if is_loader else None,
            inference_tokenizer=inference_tokenizer, adapter_path=adapter, sample=sample,
            model_config=model_config, generation_config=generation_config,
        )  # fmt: skip
        if fmt in RL_FORMATS:
            from hf_sanity.measure.batches import prompts_context

            objective = Objective("rl", "prompt-only", None, "columns")
            ctx = prompts_context(tokenizer, dataset, objective=objective, max_len=max_len, **model_side)
        elif fmt in PREFERENCE_FORMATS:
            from hf_sanity.measure.preference import rows_context

            objective = of_columns(COLUMNS[fmt])  # the format's own columns: --format decides
            ctx = rows_context(tokenizer, dataset, objective=objective, max_len=max_len, **model_side)
        else:
            ctx = Context(
                tokenizer=tokenizer,
                dataset=dataset,
                fmt=fmt,
                options=EncodeOptions(
                    fmt=fmt, loss_on=loss_on, max_len=max_len, alpaca_template=alpaca_template
                ),
                eval_dataset=eval_dataset,
                num_proc=num_proc,
                shard=True,
                task=task,
                **model_side,
            )
    from hf_sanity.measure import distributed

    # Every rank encodes its shard here (collectives under torchrun), before rank 0 alone runs the rules.
    scan_started = time.perf_counter()
    ctx.encoded  # noqa: B018
    if ctx.eval_dataset is not None:
        ctx.eval_encoded  # noqa: B018
    scanned = time.perf_counter()
    rank, size = distributed.world() if ctx.shard else (0, 1)
    if rank != 0:
        return distributed.broadcast(None)
    selection = selection.for_objective(ctx.objective.kind)
    report = run_checks(ctx, selection)
    report.notes.extend(versions.check())  # a library outside the versions supported: one note each
    if trainer is None and label_note:
        report.notes.append(label_note)
    if trainer is None and ctx.source_format == "tokens" and ctx.prompts is not None:
        report.notes.append(RL_PROMPTS_NOTE)
    if not ctx.has_model and reads_model(selection):
        report.notes.append(
            "no model was given: the model-stage checks that read its weights did not run (`hf-sanity rules "
            "--stage model`); pass model= to run them"
        )
    checked = time.perf_counter()
    model_load = sum(load_seconds)
    report.stats["seconds_by_phase"] = {  # where the wall time went (the CLI adds its own loading)
        "setup": round(scan_started - started, 2),
        "scan": round(scanned - scan_started, 2),
        "model_load": round(model_load, 2),
        "checks": round(checked - scanned - model_load, 2),
    }
    report.stats.update(
        objective=ctx.objective.kind,
        objective_detail=ctx.objective.describe(),
        format=ctx.fmt,
        examples=len(ctx),
        tokens=int(ctx.col("n_tokens").sum()),
        supervised_tokens=int(ctx.col("n_supervised_kept").sum()),
        max_len=ctx.options.max_len,
        modality=ctx.modality.kind,
        seconds=round(time.perf_counter() - started, 2),
    )
    step0 = ctx.step0_measured
    if step0 and step0.get("tokens"):  # what the step-0 check measured, finding or not
        report.stats["step0_loss"] = {
            "loss": round(step0["loss"], 4),
            "model_entropy": round(step0["entropy"], 4),
            "top1": round(step0["top1"], 4),
            "tokens": step0["tokens"],
            "adapter": ctx.adapter_path and str(ctx.adapter_path),  # scored with it attached
        }
    # The format as given, what it was read as, and how (ShareGPT roles, JSON columns, the Alpaca template).
    if ctx.pairs is not None or ctx.unpaired is not None:
        report.stats.update(_preference_stats(ctx))
    elif ctx.rl is not None:
        report.stats.update(_rl_stats(ctx.rl))
        if vars(ctx.rl).get("dry_run") is not None:  # what did not run, said (measured only if a rule asked)
            report.notes.extend(ctx.rl.dry_run.notes())
    elif trainer is None and ctx.prompts is not None:  # a prompt-only file: rendered as the RL trainer does
        report.stats.update(format="prompt-only", read_as="RL prompts (GRPO/RLOO): the chat template with the "
                            "generation prompt, text prompts as they are", prompts=len(ctx.prompts))  # fmt: skip
    elif trainer is None:
        report.stats.update(ctx.encoder.layout.describe(ctx.dataset))
        if task != "generative":
            report.stats["task"] = task
    if trainer is not None:  # the trainer read, and the framework that built it
        from hf_sanity.measure.frameworks import trainer_facts

        report.stats["trainer"] = trainer_facts(trainer)
    if ctx.objective.is_sft:  # which tokens carry loss, and what decided it (the header line says it too)
        report.stats["loss_mask"] = ctx.loss_mask.describe()
        report.header = ctx.loss_mask.line()
    if show:
        from hf_sanity.drivers.show import shown_rows

        view = shown_rows(ctx, show, dataset)
        if view is not None:
            report.views.append(view)
    if size > 1:
        report.stats["processes"] = size
        return distributed.broadcast(report)
    return report


RL_PROMPTS_NOTE = (
    "read as RL prompts (TRL's prompt-only format, for GRPOTrainer/RLOOTrainer): objective rl, each prompt rendered "
    "as the trainer renders it for generation; no loss mask (the model writes the completions), so the SFT "
    "loss-mask checks do not apply; the checks of the model's completions and the reward functions need the "
    "trainer: preflight(trainer=...) or `hf-sanity preflight -- CMD`"
)


def _preference_stats(ctx) -> dict:
    """What the preference checks read: the pairs (or KTO rows) kept, the rows TRL drops, the cut."""
    data = ctx.pairs if ctx.pairs is not None else ctx.unpaired
    out = {
        "format": "preference" if ctx.pairs is not None else "preference-unpaired",
        "pairs" if ctx.pairs is not None else "rows": len(data),
        "rows_given": data.rows_given if data.rows_given is not None else len(data),
        "max_len": ctx.options.max_len,
    }
    if ctx.trainer is None and ctx.pairs is not None:
        out["read_as"] = (
            "TRL's DPO/ORPO/CPO tokenization (prompt with the generation prompt, completion after it)"
        )
    return out


def reads_model(selection: Selection) -> bool:
    """Whether a selected rule is of the model stage, the one that reads the model's weights (the others read
    the tokenizer, the data and the config)."""
    return any(catalog.detectors("context", stages=("model",), enabled=selection.enabled))


def _rl_stats(rollouts) -> dict:
    """What the RL checks measured: the model's own completions (how many, clipped, seconds) and the reward dry run
    (each function's verdict), or why it did not run. Only what a rule asked for was measured."""
    measured = vars(rollouts)  # cached properties land in the instance's dict once measured
    out: dict = {"format": "prompt (rl)", "num_generations": rollouts.group_size}
    sampled = measured.get("sampled")
    if sampled is not None:
        out["sampled_completions"] = {
            "completions": len(sampled.clipped), "clipped_share": round(sampled.clipped_share, 3),
            "max_completion_length": sampled.max_new_tokens, "seconds": round(sampled.seconds, 2),
        }  # fmt: skip
    if not rollouts.dry_run_enabled:
        out["reward_dry_run"] = "skipped: reward_dry_run=False (no reward function was called)"
    elif "dry_run" in measured and measured["dry_run"] is not None:
        out["reward_dry_run"] = measured["dry_run"].describe()
    return out


def _timed(load, seconds: list[float]):
    """``load`` that appends the seconds it took to ``seconds``."""

    def timed():
        started = time.perf_counter()
        try:
            return load()
        finally:
            seconds.append(time.perf_counter() - started)

    return timed


def check_options(
    *,
    loss_on: str | None = None,
    max_len: int | None = None,
    sample: int = 256,
    alpaca_template: str | None = None,
    task: str = "generative",
) -> None:
    """Preflight's numbers and choices, checked before anything is loaded."""
    check_alpaca_template(alpaca_template)
    if task not in TASKS:
        raise UserInputError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if loss_on is not None and loss_on not in LOSS_ON:
        raise UserInputError(f"--loss-on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    if max_len is not None and max_len <= 0:
        raise UserInputError(f"--max-len must be positive, got {max_len}")
    if sample < 1:
        raise UserInputError(f"--sample must be at least 1, got {sample}")
