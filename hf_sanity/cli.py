"""The `hf-sanity` command line. It parses arguments and calls the library; nothing else lives here."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table

from hf_sanity.errors import UserInputError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Click's plain help: typer's rich option table cuts option names at 80 columns (`--inference-toke…`).
    rich_markup_mode=None,
    help="Sanity checks for Hugging Face fine-tuning: finds the silent bugs before and during training.",
)
console = Console()
err_console = Console(stderr=True)

SelectOpt = Annotated[
    list[str] | None,
    typer.Option("--select", help="Only these rules (slugs, stages or ALL; repeat or comma-separate)."),
]
IgnoreOpt = Annotated[
    list[str] | None, typer.Option("--ignore", help="Silence these rules (slugs or stages).")
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON to this file.")]
HtmlOpt = Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML report page.")]

# Options that several commands share: one definition each.
ModelOpt = Annotated[
    str, typer.Option(help="Model folder or hub id (its tokenizer is used unless --tokenizer).")
]
DatasetOpt = Annotated[str, typer.Option(help="JSON/JSONL/CSV/Parquet file, save_to_disk folder, or hub id.")]
TokenizerOpt = Annotated[str | None, typer.Option(help="Tokenizer folder or hub id (default: --model).")]
SplitOpt = Annotated[str, typer.Option(help="Dataset split to use.")]
MaxLenOpt = Annotated[int | None, typer.Option(help="Training max_length (truncation keeps the start).")]
LossOnOpt = Annotated[str, typer.Option(help="completion (labels on completions only) or all.")]
FORMAT_HELP = (
    "messages, sharegpt, prompt-completion, alpaca, text, tokens, preference (chosen/rejected, optional prompt) or "
    "preference-unpaired (KTO's prompt/completion/label) or prompt-only (RL prompts for GRPO/RLOO, read as the RL "
    "objective) (default: detected from the columns)."
)
FormatOpt = Annotated[str | None, typer.Option("--format", help=FORMAT_HELP)]
UnsafeFixesOpt = Annotated[
    bool,
    typer.Option(
        "--unsafe-fixes",
        help="Apply the unsafe remedies too: those that change the data (rows dropped or edited, a training argument) "
        "or the vocabulary and weights.",
    ),
]
LOSS_ON_HELP = (
    "Which tokens carry loss: completion (TRL's completion_only_loss), assistant (the assistant turns, from the "
    "chat template's {% generation %} markers, as TRL's assistant_only_loss; Axolotl's and LLaMA-Factory's "
    "default) or all. Default: what TRL's SFTTrainer does with the format (every token of messages and text "
    "rows, the completion of prompt-completion rows); the report says which it assumed."
)
TrlLossOnOpt = Annotated[str | None, typer.Option(help=LOSS_ON_HELP)]
ObjectiveOpt = Annotated[
    str | None,
    typer.Option(
        help="What the model was trained for: sft, preference, preference-unpaired, reward or rl (default: read from "
        "the dataset's columns). Preference and RL runs get policy-drift against --base."
    ),
]
AlpacaOpt = Annotated[
    str | None,
    typer.Option(
        help="Alpaca rows: chat (the chat template renders instruction+input, then output) or text (the "
        "Alpaca prompt, for base models). Default: chat when the tokenizer has a chat template."
    ),
]
TrustOpt = Annotated[bool, typer.Option(help="Allow custom model/tokenizer code.")]
# The options that shape the checks, declared once: preflight's, and fix's (which passes them on).
CheckAdapterOpt = Annotated[
    str | None, typer.Option(help="A saved PEFT adapter folder to check against the model.")
]
InferenceTokenizerOpt = Annotated[
    str | None, typer.Option(help="Tokenizer used at inference, for template parity.")
]
TaskOpt = Annotated[
    str,
    typer.Option(
        help="generative, or extractive when answers quote the prompt (extractive QA, RAG with "
        "citations): the answer in the prompt is then not label-leakage."
    ),
]
SampleOpt = Annotated[int, typer.Option(help="Examples for the model-side checks.")]
NumProcOpt = Annotated[int | None, typer.Option(help="Processes for tokenization.")]
AdapterConfigOpt = Annotated[
    Path | None, typer.Option(help="A LoRA adapter_config.json (or its folder) to attach, as in training.")
]
LoraROpt = Annotated[int | None, typer.Option(help="Attach a LoRA adapter of this rank.")]
LoraAlphaOpt = Annotated[int | None, typer.Option(help="LoRA alpha (default: 2 x rank).")]
LoraTargetOpt = Annotated[
    list[str] | None, typer.Option(help="LoRA target modules (repeat or comma-separate; default all-linear).")
]
ExamplesOpt = Annotated[int, typer.Option("--n", help="Examples to overfit (2-10).")]
StepsOpt = Annotated[int, typer.Option(help="Step budget of the overfit.")]
LrOpt = Annotated[
    float | None,
    typer.Option(
        help="Overfit learning rate, used as is and never searched (default: step 1 at 1e-3 with an adapter, "
        "1e-4 for full fine-tuning; if that does not memorise the examples and steps 2-3 pass, step 4 searches "
        "the LR: an LR range test, then runs at the LRs it suggests)."
    ),
]

# `hf-sanity run -- CMD` and `hf-sanity preflight -- CMD` (their block is below, before main).
# Everything from CMD on is the command's, its options included: hf-sanity's options go before it.
LAUNCH_CONTEXT = {"allow_interspersed_args": False}
CommandArg = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="-- CMD ...",
        help="Your training command, run unchanged: trl sft ..., accelerate launch / torchrun train.py, python "
        "train.py, a framework's CLI.",
    ),
]


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _show_progress() -> None:
    """What a long command is doing, on stderr while it works: on a terminal only (nothing when piped), cleared
    before the report prints."""
    from hf_sanity import progress

    progress.enable(err_console)


def _progress_off() -> None:
    if "hf_sanity.progress" in sys.modules:
        sys.modules["hf_sanity.progress"].disable()


def _finish(
    report,
    json_path: Path | None,
    html_path: Path | None = None,
    rows_path: Path | None = None,
    exit: bool = True,
) -> None:
    _progress_off()
    if rows_path is not None:
        report.write_rows(rows_path)
        report.stats["rows_file"] = str(rows_path)
    console.print(report)
    if rows_path is not None:
        console.print(f"[dim]offending rows written to {rows_path}[/dim]")
    if json_path is not None:
        report.write_json(json_path)
        console.print(f"[dim]report written to {json_path}[/dim]")
    if html_path is not None:
        from hf_sanity.html import write_html

        write_html(report, html_path)
        console.print(f"[dim]report page written to {html_path}[/dim]")
    if exit:
        raise typer.Exit(report.exit_code)


@app.command("rules")
def rules_command(
    stage: Annotated[str | None, typer.Option(help="Only the rules of this stage.")] = None,
) -> None:
    """List every rule: slug, default severity, stage and the symptom it explains."""
    from hf_sanity import catalog

    rules = catalog.all_rules()
    if stage is not None:
        if stage not in catalog.STAGES:
            raise UserInputError(f"unknown stage {stage!r}; use one of {', '.join(catalog.STAGES)}")
        rules = [r for r in rules if r.stage == stage]
    table = Table(show_edge=False, header_style="bold")
    for column in ("rule", "severity", "stage", "symptom"):
        table.add_column(column, overflow="fold")
    for rule in rules:
        table.add_row(rule.slug, rule.severity, rule.stage, rule.symptom)
    console.print(table)


@app.command("explain")
def explain_command(slug: Annotated[str, typer.Argument(help="A rule slug, e.g. prompt-in-loss.")]) -> None:
    """Print one rule: the symptom, how it is detected, and the fix."""
    from hf_sanity import catalog

    console.print(Markdown(catalog.get(slug).explain()))


@app.command("preflight", context_settings=LAUNCH_CONTEXT)
def preflight_command(
    model: Annotated[
        str | None, typer.Option(help="Model folder or hub id (its tokenizer is used unless --tokenizer).")
    ] = None,
    dataset: Annotated[
        str | None, typer.Option(help="JSON/JSONL/CSV/Parquet file, save_to_disk folder, or hub id.")
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="Tokenizer folder or hub id (default: --model).")
    ] = None,
    split: Annotated[str, typer.Option(help="Dataset split to inspect.")] = "train",
    eval_dataset: Annotated[str | None, typer.Option(help="Eval dataset (for split-leakage).")] = None,
    eval_split: Annotated[
        str | None, typer.Option(help="Eval split of --dataset (for split-leakage).")
    ] = None,
    max_len: Annotated[
        int | None, typer.Option(help="Training max_length (truncation keeps the start).")
    ] = None,
    adapter: CheckAdapterOpt = None,
    inference_tokenizer: InferenceTokenizerOpt = None,
    loss_on: TrlLossOnOpt = None,
    format: FormatOpt = None,
    alpaca_template: AlpacaOpt = None,
    task: TaskOpt = "generative",
    sample: SampleOpt = 256,
    num_proc: NumProcOpt = None,
    trust_remote_code: TrustOpt = False,
    json: JsonOpt = None,
    html: HtmlOpt = None,
    rows_out: Annotated[
        Path | None,
        typer.Option(
            help="Also write every offending row index per rule as JSON {rule: [rows]}, for dataset.filter "
            "(the report lists the first ten); split-leakage's rows index the eval split."
        ),
    ] = None,
    show: Annotated[
        int | None,
        typer.Option(
            "--show",
            help="Also show the first N rows decoded, as the model is fed them (every token with its id, "
            "attention, position id, label and loss); see `hf-sanity show`.",
        ),
    ] = None,
    select: SelectOpt = None,
    ignore: IgnoreOpt = None,
    fix: Annotated[
        bool,
        typer.Option(
            "--fix",
            help="Then apply the findings' remedies to a copy written to --fix-out and run the checks on the copy "
            "(see `hf-sanity fix`).",
        ),
    ] = False,
    fix_out: Annotated[
        Path | None, typer.Option(help="With --fix: a new folder for the repaired copy.")
    ] = None,
    unsafe_fixes: UnsafeFixesOpt = False,
    fix_only: Annotated[
        bool, typer.Option(hidden=True)
    ] = False,  # `hf-sanity fix`: its outcomes, not the report
    fix_diff: Annotated[bool, typer.Option(hidden=True)] = False,  # `hf-sanity fix --diff`: nothing written
    command: CommandArg = None,
) -> None:
    """Inspect model, tokenizer, data and adapter before a single training step; or, with -- CMD, the trainer your
    training command builds, stopped where its training would start."""
    if command:  # `hf-sanity preflight -- CMD`: the trainer the command builds (hf_sanity/launch, below)
        return _preflight_of_command(list(command), locals())
    for flag, value in (("--model", model), ("--dataset", dataset)):
        if value is None:
            raise UserInputError(
                f"Missing option '{flag}' (or check your training command's own trainer: `hf-sanity preflight -- "
                "CMD`; see hf-sanity preflight --help)"
            )
    from hf_sanity.drivers.preflight import check_options, reads_model
    from hf_sanity.selection import resolve

    # Bad options fail in a blink, before transformers is imported or anything is loaded.
    weights = reads_model(resolve(select, ignore))  # with the model stage off, the folder needs no weights
    check_options(loss_on=loss_on, max_len=max_len, sample=sample, alpaca_template=alpaca_template, task=task)
    if show is not None and show < 1:
        raise UserInputError(f"--show takes a number of rows (1 or more), got {show}")
    if format is not None:
        from hf_sanity.measure.formats import FORMATS

        if format not in FORMATS:
            raise UserInputError(f"unknown --format {format!r}; use one of {', '.join(FORMATS)}")
    if num_proc is not None and num_proc < 1:
        raise UserInputError(f"--num-proc must be at least 1, got {num_proc}")
    if eval_dataset and eval_split:
        raise UserInputError("pass --eval-dataset or --eval-split, not both")
    yours = (model, tokenizer, dataset, eval_dataset, adapter, inference_tokenizer)
    if fix:
        _check_fix_out(fix_out, fix_diff, yours)
    _show_progress()
    _quiet_libraries()
    from hf_sanity.drivers.preflight import preflight
    from hf_sanity.measure.adapters import adapter_config, adapter_state
    from hf_sanity.measure.sources import (
        load_config,
        load_dataset_ref,
        load_generation_config,
        load_model,
        load_tokenizer,
    )

    loading = time.perf_counter()
    # fails early on a broken model folder
    config = load_config(model, trust_remote_code=trust_remote_code, weights=weights)
    if adapter:  # an unreadable adapter fails now, not after the dataset is tokenized
        if not Path(adapter).is_dir():
            raise UserInputError(
                f"adapter {adapter!r} is not a folder; pass the folder written by peft's save_pretrained"
            )
        adapter_config(adapter)
        adapter_state(adapter)
    tok = load_tokenizer(
        tokenizer or model, trust_remote_code=trust_remote_code, kind="tokenizer" if tokenizer else "model"
    )
    data = load_dataset_ref(dataset, split)
    from hf_sanity.drivers.vlm import image_column, load_vision_processor

    pictures = image_column(data)
    processor = load_vision_processor(model, trust_remote_code=trust_remote_code) if pictures else None
    if (
        processor is not None
    ):  # vision-language rows on a model with an image processor: TRL's trainer reads them
        if fix:
            raise UserInputError(
                "--fix does not repair vision-language data yet; run preflight without --fix"
            )
        return _preflight_vlm(
            model, processor, data, pictures, dataset, max_len=max_len, loss_on=loss_on, sample=sample,
            select=select, ignore=ignore, show=show, json=json, html=html, rows_out=rows_out,
            trust_remote_code=trust_remote_code, started=loading,
        )  # fmt: skip
    eval_data = None
    if eval_dataset:
        eval_data = load_dataset_ref(eval_dataset, eval_split or split)
    elif eval_split:
        eval_data = load_dataset_ref(dataset, eval_split)
    inference_tok = (
        load_tokenizer(inference_tokenizer, trust_remote_code=trust_remote_code, kind="inference tokenizer")
        if inference_tokenizer
        else None
    )
    loaded = time.perf_counter() - loading
    inputs = dict(
        model=(lambda: load_model(model, trust_remote_code=trust_remote_code)) if weights else None,
        model_config=config,
        generation_config=load_generation_config(model),
        tokenizer=tok,
        dataset=data,
        eval_dataset=eval_data,
        max_len=max_len,
        loss_on=loss_on,
        format=format,
        alpaca_template=alpaca_template,
        task=task,
        adapter=adapter,
        inference_tokenizer=inference_tok,
        sample=sample,
        num_proc=num_proc,
        select=select,
        ignore=ignore,
        show=show,
    )
    report = preflight(**inputs)
    phases = report.stats.get("seconds_by_phase")
    if phases is not None:  # config, tokenizer and data loading come first, then preflight's own phases
        report.stats["seconds_by_phase"] = {"load": round(loaded, 2), **phases}
    report.fix_command = _fix_command_line(
        model, dataset, tokenizer=tokenizer, split=split, eval_dataset=eval_dataset, eval_split=eval_split,
        max_len=max_len, loss_on=loss_on, format=format, alpaca_template=alpaca_template, task=task,
        adapter=adapter, inference_tokenizer=inference_tokenizer, sample=sample, select=select, ignore=ignore,
        trust_remote_code=trust_remote_code,
    )  # fmt: skip
    if fix and not fix_only:  # preflight --fix: the report and its files first, then the fix
        _finish(report, json, html, rows_out, exit=False)
        console.print()
    if fix:
        _fix(report, inputs, out=fix_out, unsafe=unsafe_fixes, diff=fix_diff, model=model, yours=yours,
             json_path=json if fix_only else None, data_format=_data_format(dataset))  # fmt: skip
    _finish(report, json, html, rows_out)


def _preflight_vlm(model, processor, data, pictures, dataset, *, max_len, loss_on, sample, select, ignore, show,
                   json, html, rows_out, trust_remote_code, started) -> None:  # fmt: skip
    """preflight(trainer=) on TRL's SFTTrainer built from the model folder, its processor and the rows whose
    picture paths are read relative to the data file; the trainer's output folder is a temporary one."""
    import tempfile

    from hf_sanity.drivers.preflight import preflight
    from hf_sanity.drivers.vlm import data_folder, vlm_trainer, with_pictures

    data = with_pictures(data, pictures, data_folder(dataset), dataset)
    with tempfile.TemporaryDirectory(prefix="hf-sanity-vlm-") as scratch:
        trainer = vlm_trainer(
            model, processor, data, max_len=max_len, loss_on=loss_on, output_dir=scratch,
            trust_remote_code=trust_remote_code,
        )  # fmt: skip
        loaded = time.perf_counter() - started
        report = preflight(
            trainer=trainer, dataset=data, sample=sample, select=select, ignore=ignore, show=show
        )
    phases = report.stats.get("seconds_by_phase")
    if phases is not None:
        report.stats["seconds_by_phase"] = {"load": round(loaded, 2), **phases}
    _finish(report, json, html, rows_out)


@app.command("show")
def show_command(
    model: ModelOpt,
    dataset: DatasetOpt,
    tokenizer: TokenizerOpt = None,
    split: SplitOpt = "train",
    rows: Annotated[
        str | None, typer.Option(help="Rows of the dataset to show: 0,5 or 0-3 (default: 0,1).")
    ] = None,
    trainer_batch: Annotated[
        bool,
        typer.Option(
            "--trainer-batch",
            help="Build TRL's SFTTrainer on the model and the rows and show its batch (after its own "
            "tokenization and collator); needs the model's weights and trl.",
        ),
    ] = False,
    max_len: MaxLenOpt = None,
    loss_on: TrlLossOnOpt = None,
    format: FormatOpt = None,
    alpaca_template: AlpacaOpt = None,
    trust_remote_code: TrustOpt = False,
    json: JsonOpt = None,
    html: HtmlOpt = None,
) -> None:
    """Show the exact tensors the model will be fed, decoded: every token with its id, attention mask, position
    id, label and whether it carries loss; padding, packed sequences and the labels' shift marked."""
    from hf_sanity.drivers.preflight import check_options
    from hf_sanity.drivers.show import parse_rows

    picked = parse_rows(rows)
    check_options(loss_on=loss_on, max_len=max_len, alpaca_template=alpaca_template)
    _quiet_libraries()
    from hf_sanity.drivers.show import show
    from hf_sanity.measure.sources import load_config, load_dataset_ref, load_model, load_tokenizer

    load_config(model, trust_remote_code=trust_remote_code, weights=trainer_batch)
    tok = load_tokenizer(
        tokenizer or model, trust_remote_code=trust_remote_code, kind="tokenizer" if tokenizer else "model"
    )
    data = load_dataset_ref(dataset, split)
    report = show(
        model=(lambda: load_model(model, trust_remote_code=trust_remote_code)) if trainer_batch else None,
        tokenizer=tok, dataset=data, rows=picked, trainer_batch=trainer_batch, max_len=max_len, loss_on=loss_on,
        format=format, alpaca_template=alpaca_template, source=dataset,
    )  # fmt: skip
    _finish(report, json, html)


@app.command("fix")
def fix_command(
    model: ModelOpt,
    dataset: DatasetOpt,
    out: Annotated[
        Path | None,
        typer.Option(
            help="A new folder for the repaired copy: a complete model folder (unchanged files hard-linked to "
            "yours), the data in its own format when it changed (dataset.jsonl, dataset.parquet, ...), and "
            "fixes.json / fixes.md. Not inside your model or data folders."
        ),
    ] = None,
    unsafe_fixes: UnsafeFixesOpt = False,
    diff: Annotated[
        bool, typer.Option("--diff", help="Print the changes (and check them) without writing.")
    ] = False,
    tokenizer: TokenizerOpt = None,
    split: SplitOpt = "train",
    eval_dataset: Annotated[str | None, typer.Option(help="Eval dataset (split-leakage).")] = None,
    eval_split: Annotated[str | None, typer.Option(help="Eval split of --dataset (split-leakage).")] = None,
    max_len: MaxLenOpt = None,
    loss_on: TrlLossOnOpt = None,
    format: FormatOpt = None,
    alpaca_template: AlpacaOpt = None,
    task: TaskOpt = "generative",
    adapter: CheckAdapterOpt = None,
    inference_tokenizer: InferenceTokenizerOpt = None,
    sample: SampleOpt = 256,
    num_proc: NumProcOpt = None,
    trust_remote_code: TrustOpt = False,
    json: Annotated[
        Path | None, typer.Option("--json", help="Also write what changed and the outcomes as JSON.")
    ] = None,
    select: SelectOpt = None,
    ignore: IgnoreOpt = None,
) -> None:
    """Repair what preflight finds, on a copy: apply each finding's remedy (safe ones; unsafe ones with
    --unsafe-fixes), write the repaired model folder to --out, run the checks on it and report each finding
    fixed, not fixed or display only. Exit 0 only if every error was fixed."""
    if out is None and not diff:
        raise UserInputError(
            "pass --out DIR (a new folder for the repaired copy), or --diff to see the changes"
        )
    preflight_command(
        model=model, dataset=dataset, tokenizer=tokenizer, split=split, eval_dataset=eval_dataset,
        eval_split=eval_split, max_len=max_len, loss_on=loss_on, format=format, alpaca_template=alpaca_template,
        task=task, adapter=adapter, inference_tokenizer=inference_tokenizer, sample=sample, num_proc=num_proc,
        trust_remote_code=trust_remote_code, json=json, select=select, ignore=ignore, fix=True, fix_out=out,
        unsafe_fixes=unsafe_fixes, fix_only=True, fix_diff=diff,
    )  # fmt: skip


def _check_fix_out(out: Path | None, diff: bool, yours) -> None:
    """The folder for the repaired copy is given, new or empty, and none of the user's (before any loading)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserInputError("fix runs in one process: run it without torchrun or accelerate launch")
    if diff:
        return
    if out is None:
        raise UserInputError("--fix needs --fix-out DIR: a new folder for the repaired copy")
    from hf_sanity.drivers.fix import check_out

    check_out(out, protect=yours)


def _fix_command_line(model: str, dataset: str, **options) -> str:
    """`hf-sanity fix` with the options preflight ran with that change what is checked (those at `fix`'s own
    default left out), so that the fix checks the run preflight checked."""
    import inspect
    import shlex

    defaults = {name: p.default for name, p in inspect.signature(fix_command).parameters.items()}
    args = ["hf-sanity", "fix", "--model", model, "--dataset", dataset]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if name not in defaults:
            raise TypeError(f"`hf-sanity fix` has no {flag}")  # a preflight option fix does not pass on
        if value is None or value is False or value == defaults[name]:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            args += [a for v in value for a in (flag, str(v))]
        else:
            args += [flag, str(value)]
    return " ".join(shlex.quote(a) for a in args) + " --out DIR"


def _data_format(ref: str) -> str:
    """The format the repaired data is written in: the format of ``ref`` (a hub id: Parquet, with its types)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        has_info = (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
        return "arrow" if has_info else "parquet"
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(suffix, "parquet")


def _fix(report, inputs: dict, *, out, unsafe: bool, diff: bool, model: str, yours, json_path,
         data_format: str) -> None:  # fmt: skip
    """The remedies of ``report`` applied to a copy of ``inputs`` and checked: the outcomes printed (the diff
    first with --diff), the copy written to ``out`` (not with --diff); exits 0 only if no error is left."""
    from hf_sanity import progress
    from hf_sanity.drivers.fix import fix, render_diff
    from hf_sanity.report import write_atomic

    with progress.phase("fixing a copy and checking it again"):
        fixed = fix(report=report, unsafe=unsafe, use_config=True, data_format=data_format, **inputs)
    _progress_off()
    if diff:
        console.print(render_diff(fixed.diff()) if fixed.changed else "no changes")
    console.print(fixed)
    if not diff:
        folder = _model_files(model)
        where = fixed.save(out, model_folder=folder, protect=yours)
        console.print(f"[dim]{fixed.saved_summary(where, folder)}[/dim]", highlight=False)
    if json_path is not None:
        import json

        write_atomic(json_path, json.dumps(fixed.to_dict(), indent=2, ensure_ascii=False) + "\n")
        console.print(f"[dim]fixes written to {json_path}[/dim]")
    raise typer.Exit(fixed.exit_code)


def _model_files(model: str) -> str | None:
    """The folder of the model's files: the folder given, or a hub id's snapshot in the local cache (its
    files are linked into the repaired copy, not downloaded and saved again); None when not cached."""
    if Path(model).expanduser().is_dir():
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception:  # not in the cache (or not a hub id): the model object is saved instead
        return None


@app.command("outputs")
def outputs_command(
    model: ModelOpt,
    dataset: Annotated[
        str,
        typer.Option(
            help="Held-out prompts: conversations (their last answer is the reference), prompt/completion or "
            "prompt-only rows, Alpaca rows (JSON/JSONL/CSV/Parquet file, save_to_disk folder, or hub id)."
        ),
    ],
    adapter: Annotated[
        str | None, typer.Option(help="A saved PEFT adapter folder, applied to --model for the run.")
    ] = None,
    base: Annotated[
        str | None,
        typer.Option(help="The base model (folder or hub id): its outputs are compared (adapter-no-effect)."),
    ] = None,
    tokenizer: TokenizerOpt = None,
    inference_tokenizer: Annotated[
        str | None,
        typer.Option(
            help="The tokenizer you serve with: its chat template renders the prompts (default: --tokenizer)."
        ),
    ] = None,
    split: Annotated[
        str | None,
        typer.Option(help="Dataset split (default: test, else validation; a single file is its split)."),
    ] = None,
    n: Annotated[int, typer.Option("--n", help="Prompts to generate for.")] = 32,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated at most per prompt.")] = 256,
    batch_size: Annotated[int, typer.Option(help="Prompts per generate() call (left-padded).")] = 32,
    format: FormatOpt = None,
    alpaca_template: AlpacaOpt = None,
    objective: ObjectiveOpt = None,
    seed: Annotated[int, typer.Option(help="Seed set before generating (generation is greedy).")] = 0,
    trust_remote_code: TrustOpt = False,
    json: JsonOpt = None,
    html: HtmlOpt = None,
    select: SelectOpt = None,
    ignore: IgnoreOpt = None,
) -> None:
    """Check what the fine-tuned model says: generate for held-out prompts, rendered as served, and find answers
    that never stop, echo the prompt, carry template markers, loop, stop short, or equal the base model's."""
    from hf_sanity.drivers.outputs import check_adapter_folder, check_options
    from hf_sanity.selection import resolve

    resolve(select, ignore)  # bad options fail before anything is imported or loaded
    check_options(
        n=n, max_new_tokens=max_new_tokens, batch_size=batch_size, alpaca_template=alpaca_template,
        objective=objective,
    )  # fmt: skip
    if format is not None:
        from hf_sanity.measure.formats import FORMATS

        if format not in FORMATS:
            raise UserInputError(f"unknown --format {format!r}; use one of {', '.join(FORMATS)}")
    _quiet_libraries()
    from hf_sanity.drivers.outputs import outputs
    from hf_sanity.measure.sources import load_config, load_model, load_tokenizer

    load_config(
        model, trust_remote_code=trust_remote_code
    )  # a broken model folder fails before the data loads
    if adapter:
        check_adapter_folder(adapter)
    tok = load_tokenizer(
        tokenizer or model, trust_remote_code=trust_remote_code, kind="tokenizer" if tokenizer else "model"
    )
    served = (
        load_tokenizer(inference_tokenizer, trust_remote_code=trust_remote_code, kind="inference tokenizer")
        if inference_tokenizer
        else None
    )
    data = _prompts_split(dataset, split)
    fine_tuned = load_model(model, trust_remote_code=trust_remote_code)
    base_model = None
    if base is not None:
        same = adapter is not None and Path(base).expanduser().resolve() == Path(model).expanduser().resolve()
        base_model = fine_tuned if same else load_model(base, trust_remote_code=trust_remote_code)
    report = outputs(
        model=fine_tuned,
        tokenizer=tok,
        dataset=data,
        adapter=adapter,
        base=base_model,
        inference_tokenizer=served,
        n=n,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        format=format,
        alpaca_template=alpaca_template,
        objective=objective,
        seed=seed,
        select=select,
        ignore=ignore,
    )
    _finish(report, json, html)


def _prompts_split(dataset: str, split: str | None):
    """The held-out split: ``split``, else ``test``, else ``validation`` (a single file is its one split)."""
    from hf_sanity.measure.sources import load_dataset_ref

    if split is not None:
        return load_dataset_ref(dataset, split)
    try:
        return load_dataset_ref(dataset, "test")
    except UserInputError as exc:
        if "has no split" not in str(exc):
            raise
        try:
            return load_dataset_ref(dataset, "validation")
        except UserInputError:
            raise UserInputError(
                f"dataset {dataset!r} has no test or validation split: pass --split with the held-out one"
            ) from None


@app.command("demo")
def demo_command() -> None:
    """Show what hf-sanity does on the embedded tiny model: a correct setup, then a broken one."""
    _quiet_libraries()
    from hf_sanity.demo import run_demo

    raise typer.Exit(run_demo(console))


@app.command("doctor")
def doctor_command(
    runs: Annotated[
        list[str],
        typer.Argument(
            metavar="RUN", help="Finished runs: trainer_state.json files, checkpoint folders or output_dirs."
        ),
    ],
    predictions: Annotated[
        Path | None,
        typer.Option(help='JSONL of {"prediction": ..., "label": ...} and/or {"score": ...} rows.'),
    ] = None,
    baseline: Annotated[
        float | None,
        typer.Option(help="An accuracy to judge the predictions against (0.9 for 90%): see --baseline-kind."),
    ] = None,
    baseline_kind: Annotated[
        str,
        typer.Option(help="human (an accuracy above it is suspect: leakage) or majority (not above it is)."),
    ] = "human",
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Also draw the curves with the findings as a PNG.")
    ] = None,
    json: JsonOpt = None,
    html: HtmlOpt = None,
    select: SelectOpt = None,
    ignore: IgnoreOpt = None,
) -> None:
    """Post-mortem of finished runs: loss and eval curves, runs compared, eval predictions (per class, against
    a baseline)."""
    from hf_sanity.drivers.doctor import check_baseline
    from hf_sanity.selection import resolve

    resolve(select, ignore)  # an unknown slug fails before anything is read
    check_baseline(baseline, baseline_kind, predictions)
    _show_progress()
    _quiet_libraries()
    from hf_sanity.drivers.doctor import doctor

    report = doctor(
        runs, predictions=predictions, select=select, ignore=ignore, plot=plot, with_plot=html is not None,
        baseline=baseline, baseline_kind=baseline_kind,
    )  # fmt: skip
    if plot is not None:
        console.print(f"[dim]plot written to {plot}[/dim]")
    _finish(report, json, html)


@app.command("served")
def served_command(
    model: Annotated[
        str, typer.Option(help="The served model: the merged model folder a server loads (or hub id).")
    ],
    base: Annotated[str, typer.Option(help="The base model the adapter was trained on (folder or hub id).")],
    adapter: Annotated[str, typer.Option(help="The trained PEFT adapter folder (save_pretrained's output).")],
    dataset: Annotated[
        str | None,
        typer.Option(help="Rows to compare the logits on (default: a few built-in conversations)."),
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="Tokenizer folder or hub id (default: --model's).")
    ] = None,
    split: SplitOpt = "train",
    sample: Annotated[int, typer.Option(help="Examples to compare the logits on.")] = 8,
    trust_remote_code: TrustOpt = False,
    json: JsonOpt = None,
    html: HtmlOpt = None,
    select: SelectOpt = None,
    ignore: IgnoreOpt = None,
) -> None:
    """Check that the served model computes what was trained: base + adapter against the merged model."""
    from hf_sanity.selection import resolve

    resolve(select, ignore)
    if sample < 1:
        raise UserInputError(f"--sample must be at least 1, got {sample}")
    if not Path(adapter).is_dir():
        raise UserInputError(
            f"adapter {adapter!r} is not a folder; pass the folder written by peft's save_pretrained"
        )
    _quiet_libraries()
    from hf_sanity.drivers.served import served
    from hf_sanity.measure.adapters import adapter_config, adapter_state, fit_to_adapter
    from hf_sanity.measure.sources import load_config, load_dataset_ref, load_model, load_tokenizer

    adapter_config(adapter)
    state = adapter_state(adapter)  # an unreadable adapter fails before a model is loaded
    load_config(model, trust_remote_code=trust_remote_code)
    load_config(base, trust_remote_code=trust_remote_code)
    tok = load_tokenizer(
        tokenizer or model, trust_remote_code=trust_remote_code, kind="tokenizer" if tokenizer else "model"
    )
    data = load_dataset_ref(dataset, split) if dataset else None
    served_model = load_model(model, trust_remote_code=trust_remote_code)
    base_model = load_model(base, dtype=served_model.dtype, trust_remote_code=trust_remote_code)
    fit_to_adapter(base_model, state)  # tokens added for training: the base resized as it was then
    report = served(
        served_model, base=base_model, adapter=adapter, tokenizer=tok, dataset=data, sample=sample,
        select=select, ignore=ignore,
    )  # fmt: skip
    _finish(report, json, html)


def _protocol_options(
    n: int, steps: int, lr: float | None, max_len: int | None, loss_on: str, format, alpaca_template=None
):
    """The shared options of overfit and diagnose, checked before anything is imported or loaded."""
    from hf_sanity.protocol.options import ProtocolOptions

    return ProtocolOptions(
        n=n,
        steps=steps,
        lr=lr,
        max_len=max_len,
        loss_on=loss_on,
        format=format,
        alpaca_template=alpaca_template,
    )


def _pipeline(options, *, model, dataset, tokenizer, split, adapter_config, lora_r, lora_alpha, lora_target,
              trust_remote_code):  # fmt: skip
    """The pipeline overfit and diagnose train on, loaded from the command line's paths."""
    _show_progress()
    from hf_sanity import progress

    with progress.phase("importing torch and transformers"):  # on screen before the slow imports, not after
        _quiet_libraries()
        import torch  # noqa: F401

        from hf_sanity.protocol.build import from_paths
    return from_paths(
        model, dataset, options=options, tokenizer=tokenizer, split=split, adapter_config=adapter_config,
        lora_r=lora_r, lora_alpha=lora_alpha, lora_target=lora_target, trust_remote_code=trust_remote_code,
        command=sys.argv,
    )  # fmt: skip


@app.command("overfit")
def overfit_command(
    model: ModelOpt,
    dataset: DatasetOpt,
    tokenizer: TokenizerOpt = None,
    split: SplitOpt = "train",
    adapter_config: AdapterConfigOpt = None,
    lora_r: LoraROpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_target: LoraTargetOpt = None,
    n: ExamplesOpt = 8,
    steps: StepsOpt = 300,
    lr: LrOpt = None,
    max_len: MaxLenOpt = None,
    loss_on: LossOnOpt = "completion",
    format: FormatOpt = None,
    alpaca_template: AlpacaOpt = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Also draw the loss curve as a PNG.")] = None,
    trust_remote_code: TrustOpt = False,
    json: JsonOpt = None,
    html: HtmlOpt = None,
) -> None:
    """Overfit a handful of examples of your pipeline: if the loss does not reach near zero, name the broken link."""
    options = _protocol_options(n, steps, lr, max_len, loss_on, format, alpaca_template)
    pipeline = _pipeline(
        options, model=model, dataset=dataset, tokenizer=tokenizer, split=split, adapter_config=adapter_config,
        lora_r=lora_r, lora_alpha=lora_alpha, lora_target=lora_target, trust_remote_code=trust_remote_code,
    )  # fmt: skip
    from hf_sanity.protocol import overfit

    report = overfit(pipeline=pipeline, options=options, plot=plot, with_plot=html is not None)
    if plot is not None:
        console.print(f"[dim]plot written to {plot}[/dim]")
    _finish(report, json, html)


@app.command("diagnose")
def diagnose_command(
    model: ModelOpt,
    dataset: DatasetOpt,
    tokenizer: TokenizerOpt = None,
    split: SplitOpt = "train",
    adapter_config: AdapterConfigOpt = None,
    lora_r: LoraROpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_target: LoraTargetOpt = None,
    n: ExamplesOpt = 8,
    steps: StepsOpt = 300,
    lr: LrOpt = None,
    max_len: MaxLenOpt = None,
    loss_on: LossOnOpt = "completion",
    format: FormatOpt = None,
    alpaca_template: AlpacaOpt = None,
    repro: Annotated[
        Path | None,
        typer.Option(help="Folder for the single-batch reproduction (default: ./hf-sanity-repro/...)."),
    ] = None,
    trust_remote_code: TrustOpt = False,
    json: JsonOpt = None,
    html: HtmlOpt = None,
) -> None:
    """Run the debugging protocol in order (overfit, step-0 loss, shapes and masks, LR range, precision) and stop at
    the first broken layer, with its fix, a single-batch reproduction and the verification checklist."""
    options = _protocol_options(n, steps, lr, max_len, loss_on, format, alpaca_template)
    pipeline = _pipeline(
        options, model=model, dataset=dataset, tokenizer=tokenizer, split=split, adapter_config=adapter_config,
        lora_r=lora_r, lora_alpha=lora_alpha, lora_target=lora_target, trust_remote_code=trust_remote_code,
    )  # fmt: skip
    from hf_sanity.protocol import diagnose

    report = diagnose(pipeline=pipeline, options=options, repro=repro, with_plot=html is not None)
    _finish(report, json, html)


# -- your own training command: `hf-sanity run -- CMD`, `hf-sanity preflight -- CMD` (hf_sanity/launch) -------


@app.command("run", context_settings=LAUNCH_CONTEXT)
def run_command(
    command: CommandArg = None,
    abort_on: Annotated[
        str,
        typer.Option(
            help="error: stop training after the step of the first finding of severity error (warnings and info "
            "never stop it); never: only report."
        ),
    ] = "never",
    select: SelectOpt = None,
    ignore: IgnoreOpt = None,
    report: Annotated[
        Path | None,
        typer.Option(
            "--report",
            help="Also write the run where `hf-sanity doctor DIR` reads it: DIR/trainer_state.json and "
            "DIR/hf-sanity/report.json (DIR/trainer-<i>/ for each of several trainers).",
        ),
    ] = None,
    json: JsonOpt = None,
    html: HtmlOpt = None,
) -> None:
    """Run your training command with SanityCallback on every Trainer it builds (TRL's and any subclass), in every
    process it starts; then print the report (rank 0's). The exit code is the command's."""
    from hf_sanity.launch.command import combined, stopping_rules, write_run_folder

    command = _command_line(command, "run")
    if abort_on not in ("error", "never"):
        raise UserInputError(f"--abort-on must be error or never, got {abort_on!r}")
    stops = stopping_rules(select, ignore)  # an unknown slug fails before the command starts
    if abort_on == "error":  # say which findings stop the run before it starts: errors only
        err_console.print(_abort_line(stops), highlight=False, soft_wrap=True, markup=False)
    outcome = _launched(command, mode="run", abort_on=abort_on, select=select, ignore=ignore)
    watched = combined(outcome, command)
    if watched is None:
        err_console.print(
            f"hf-sanity run: {_nothing_checked(outcome, 'trained')}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(outcome.code)
    console.print(f"[dim]hf-sanity run: {_watched_line(outcome)}[/dim]", highlight=False)
    if report is not None:
        for folder in write_run_folder(report, outcome):
            console.print(f"[dim]run written to {folder} (hf-sanity doctor {folder})[/dim]", highlight=False)
    _finish(watched, json, html, exit=False)
    raise typer.Exit(outcome.code)


_EXAMPLE_STOPS = ("nonfinite-loss", "loss-diverged", "truncated-completion", "reward-function-broken")


def _abort_line(stops: list[str]) -> str:
    if not stops:
        return "hf-sanity run: --abort-on error, but no rule of severity error is selected: nothing will stop the run"
    examples = [s for s in _EXAMPLE_STOPS if s in stops] or stops[:4]
    return (
        "hf-sanity run: --abort-on error: training stops after the step of the first finding of severity error "
        f"(e.g. {', '.join(examples)}; `hf-sanity rules` lists each rule's severity, [tool.hf-sanity] severity "
        "changes it); warnings and info never stop it"
    )


def _command_line(command: list[str] | None, name: str) -> list[str]:
    if not command:
        raise UserInputError(
            f"pass your training command after --, e.g. `hf-sanity {name} -- trl sft --model_name_or_path ...`"
        )
    return list(command)


def _launched(command: list[str], **settings):
    """The outcome of ``command`` run with hf-sanity in its processes; a command that cannot start is one line
    and the shell's exit code for it (127: not found)."""
    from hf_sanity.launch.command import CommandDidNotStart, launch

    settings = {k: tuple(v) if k in ("select", "ignore") and v else v for k, v in settings.items()}
    try:
        return launch(command, settings)
    except CommandDidNotStart as exc:
        err_console.print(f"hf-sanity: {exc}", highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(exc.code) from None


def _watched_line(outcome) -> str:
    trainers = [record.get("trainer") for record, _ in outcome.reports]
    processes = len({a.get("pid") for a in outcome.attached}) or 1
    ranks = sorted({a.get("rank") for a in outcome.attached if isinstance(a.get("rank"), int)})
    where = f"{processes} processes (ranks {', '.join(map(str, ranks))}); the report is rank 0's" if len(ranks) > 1 \
        else "1 process" if processes == 1 else f"{processes} processes"  # fmt: skip
    what = trainers[0] if len(trainers) == 1 else f"{len(trainers)} trainers ({', '.join(trainers)})"
    return f"SanityCallback watched {what} in {where}; the command exited with {outcome.code}"


def _nothing_checked(outcome, verb: str) -> str:
    built = sorted({a.get("trainer") for a in outcome.attached if a.get("trainer")})
    if built:
        return (
            f"the command built {', '.join(built)} but exited (code {outcome.code}) before it {verb}: nothing was "
            "checked"
        )
    return (
        f"the command exited (code {outcome.code}) without building a transformers Trainer in a Python process "
        "hf-sanity could reach: nothing was checked"
    )


# preflight's options that describe a setup to load, and their defaults: with -- CMD the trainer is read instead
SETUP_OPTIONS = {"model": None, "dataset": None, "tokenizer": None, "split": "train", "eval_dataset": None,
                 "eval_split": None, "max_len": None, "adapter": None, "inference_tokenizer": None,
                 "loss_on": None, "format": None, "alpaca_template": None, "task": "generative",
                 "num_proc": None, "trust_remote_code": False, "fix": False, "fix_out": None,
                 "unsafe_fixes": False}  # fmt: skip
COMMAND_OPTIONS = ("select", "ignore", "sample", "show", "json", "html", "rows_out")


def _preflight_of_command(command: list[str], given: dict) -> None:
    """`hf-sanity preflight -- CMD`: preflight on the trainer the command builds, where its train() would start
    (``given``: preflight's options as parsed)."""
    loads = [f"--{k.replace('_', '-')}" for k, default in SETUP_OPTIONS.items() if given[k] != default]
    if loads:
        raise UserInputError(
            f"{', '.join(loads)} describe(s) a setup to load; with -- CMD the checks read the trainer your command "
            "builds: pass one or the other"
        )
    options = {k: given[k] for k in COMMAND_OPTIONS}
    json_path, html_path, rows_path = options.pop("json"), options.pop("html"), options.pop("rows_out")
    if options["show"] is not None and options["show"] < 1:
        raise UserInputError(f"--show takes a number of rows (1 or more), got {options['show']}")
    if options["sample"] < 1:
        raise UserInputError(f"--sample must be at least 1, got {options['sample']}")
    from hf_sanity.selection import resolve

    resolve(options["select"], options["ignore"])  # an unknown slug fails before the command starts
    outcome = _launched(command, mode="preflight", **options)
    if outcome.code == 130 and not outcome.reports:
        err_console.print("aborted")
        raise typer.Exit(130)
    failed = next((f for f in outcome.failures if f.get("input")), None) or next(iter(outcome.failures), None)
    if failed is not None and not outcome.reports:
        raise UserInputError(
            f"preflight could not check the command's {failed.get('trainer')}: {failed['message']}"
        )
    if not outcome.reports:
        raise UserInputError(_nothing_checked(outcome, "started training"))
    from hf_sanity.launch.command import combined

    report = combined(outcome, command)
    _finish(report, json_path, html_path, rows_path)


def main() -> None:
    """Entry point: bad input is one line on stderr and exit code 2, never a traceback."""
    try:
        try:
            code = app(standalone_mode=False)  # click returns the typer.Exit code in this mode
        finally:
            _progress_off()  # before any message: the display is cleared first
        sys.exit(code or 0)
    except UserInputError as exc:
        err_console.print(f"[bold red]error:[/bold red] {exc}", highlight=False, soft_wrap=True, markup=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("aborted")
        sys.exit(130)
    except Exception as exc:
        # Usage errors from click (which typer may vendor): one line too, with where the help is.
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            ctx = getattr(exc, "ctx", None)
            where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            message = " ".join(exc.format_message().split())
            err_console.print(
                f"[bold red]error:[/bold red] {message}{where}", highlight=False, soft_wrap=True
            )
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
