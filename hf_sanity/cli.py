"""The `hf-sanity` command line: it parses the options (declared once, in `cli_options`), calls a driver
(`drivers/commands.py`, which loads through `drivers/load.py`) and renders what it returns; nothing else here."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from hf_sanity import cli_options as opt
from hf_sanity.drivers import commands
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


def _show_progress(lines: bool = False) -> None:
    """What a long command is doing, on stderr while it works: on a terminal, cleared before the report prints;
    piped, nothing, or with ``lines`` one line per phase."""
    from hf_sanity import progress

    progress.enable(err_console, lines=lines)


def _progress_off() -> None:
    if "hf_sanity.progress" in sys.modules:
        sys.modules["hf_sanity.progress"].disable()


def _options(given: dict) -> dict:
    """A command's options as parsed, for its driver: the report files (--json, --html) are the CLI's."""
    return {name: value for name, value in given.items() if name not in ("json", "html")}


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
def rules_command(stage: opt.StageOpt = None) -> None:
    """List every rule: slug, default severity, stage and the symptom it explains."""
    from rich.table import Table

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
def explain_command(slug: opt.SlugArg) -> None:
    """Print one rule: the symptom, how it is detected, and the fix."""
    from rich.markdown import Markdown

    from hf_sanity import catalog

    console.print(Markdown(catalog.get(slug).explain()))


@app.command("preflight", context_settings=opt.LAUNCH_CONTEXT)
def preflight_command(
    model: opt.OptionalModelOpt = None,
    dataset: opt.OptionalDatasetOpt = None,
    tokenizer: opt.TokenizerOpt = None,
    split: opt.InspectSplitOpt = "train",
    eval_dataset: opt.EvalDatasetOpt = None,
    eval_split: opt.EvalSplitOpt = None,
    max_len: opt.MaxLenOpt = None,
    adapter: opt.CheckAdapterOpt = None,
    inference_tokenizer: opt.InferenceTokenizerOpt = None,
    loss_on: opt.TrlLossOnOpt = None,
    format: opt.FormatOpt = None,
    alpaca_template: opt.AlpacaOpt = None,
    task: opt.TaskOpt = "generative",
    sample: opt.SampleOpt = 256,
    num_proc: opt.NumProcOpt = None,
    trust_remote_code: opt.TrustOpt = False,
    json: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    rows_out: opt.RowsOutOpt = None,
    show: opt.ShowOpt = None,
    select: opt.SelectOpt = None,
    ignore: opt.IgnoreOpt = None,
    fix: opt.FixOpt = False,
    fix_out: opt.FixOutOpt = None,
    unsafe_fixes: opt.UnsafeFixesOpt = False,
    command: opt.CommandArg = None,
) -> None:
    """Inspect model, tokenizer, data and adapter before a single training step; or, with -- CMD, the trainer your
    training command builds, stopped where its training would start."""
    given = dict(locals())
    if command:  # `hf-sanity preflight -- CMD`: the trainer the command builds (hf_sanity/launch, below)
        return _preflight_of_command(list(command), given)

    _show_progress()
    report, inputs = commands.preflight_paths(**commands.shaping(given), show=show, fix=fix, fix_out=fix_out)
    if fix:  # preflight --fix: the report and its files first, then the fix
        _finish(report, json, html, rows_out, exit=False)
        console.print()
        _fixed(report, inputs, given, out=fix_out, unsafe=unsafe_fixes, diff=False, json_path=None)
    _finish(report, json, html, rows_out)


@app.command("show")
def show_command(
    model: opt.ModelOpt,
    dataset: opt.DatasetOpt,
    tokenizer: opt.TokenizerOpt = None,
    split: opt.SplitOpt = "train",
    rows: opt.ShowRowsOpt = None,
    trainer_batch: opt.TrainerBatchOpt = False,
    max_len: opt.MaxLenOpt = None,
    loss_on: opt.TrlLossOnOpt = None,
    format: opt.FormatOpt = None,
    alpaca_template: opt.AlpacaOpt = None,
    trust_remote_code: opt.TrustOpt = False,
    json: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
) -> None:
    """Show the exact tensors the model will be fed, decoded: every token with its id, attention mask, position
    id, label and whether it carries loss; padding, packed sequences and the labels' shift marked."""

    _finish(commands.show_paths(**_options(locals())), json, html)


@app.command("fix")
def fix_command(
    model: opt.ModelOpt,
    dataset: opt.DatasetOpt,
    out: opt.FixFolderOpt = None,
    unsafe_fixes: opt.UnsafeFixesOpt = False,
    diff: opt.DiffOpt = False,
    tokenizer: opt.TokenizerOpt = None,
    split: opt.SplitOpt = "train",
    eval_dataset: opt.FixEvalDatasetOpt = None,
    eval_split: opt.FixEvalSplitOpt = None,
    max_len: opt.MaxLenOpt = None,
    loss_on: opt.TrlLossOnOpt = None,
    format: opt.FormatOpt = None,
    alpaca_template: opt.AlpacaOpt = None,
    task: opt.TaskOpt = "generative",
    adapter: opt.CheckAdapterOpt = None,
    inference_tokenizer: opt.InferenceTokenizerOpt = None,
    sample: opt.SampleOpt = 256,
    num_proc: opt.NumProcOpt = None,
    trust_remote_code: opt.TrustOpt = False,
    json: opt.FixJsonOpt = None,
    select: opt.SelectOpt = None,
    ignore: opt.IgnoreOpt = None,
) -> None:
    """Repair what preflight finds, on a copy: apply each finding's remedy (safe ones; unsafe ones with
    --unsafe-fixes), write the repaired model folder to --out, run the checks on it and report each finding
    fixed, not fixed or display only. Exit 0 only if every error was fixed."""
    if out is None and not diff:
        raise UserInputError(
            "pass --out DIR (a new folder for the repaired copy), or --diff to see the changes"
        )
    given = dict(locals())
    _show_progress()
    report, inputs = commands.preflight_paths(**commands.shaping(given), fix=True, fix_out=out, diff=diff)
    _fixed(report, inputs, given, out=out, unsafe=unsafe_fixes, diff=diff, json_path=json)


def _fixed(report, inputs: dict, given: dict, *, out, unsafe: bool, diff: bool, json_path) -> None:
    """The remedies of ``report`` applied to a copy of ``inputs`` and checked: the outcomes printed (the diff
    first with --diff), the copy written to ``out`` (not with --diff); exits 0 only if no error is left."""
    from hf_sanity.drivers.fix import render_diff

    fixed = commands.fix_setup(report, inputs, unsafe=unsafe, dataset=given["dataset"])
    _progress_off()
    if diff:
        console.print(render_diff(fixed.diff()) if fixed.changed else "no changes")
    console.print(fixed)
    if not diff:
        summary = commands.save_fixed(fixed, out, model=given["model"], protect=commands.user_paths(**given))
        console.print(f"[dim]{summary}[/dim]", highlight=False)
    if json_path is not None:
        commands.write_fixes(fixed, json_path)
        console.print(f"[dim]fixes written to {json_path}[/dim]")
    raise typer.Exit(fixed.exit_code)


@app.command("outputs")
def outputs_command(
    model: opt.ModelOpt,
    dataset: opt.PromptsOpt,
    adapter: opt.AppliedAdapterOpt = None,
    base: opt.ComparedBaseOpt = None,
    tokenizer: opt.TokenizerOpt = None,
    inference_tokenizer: opt.ServedTokenizerOpt = None,
    split: opt.HeldOutSplitOpt = None,
    n: opt.PromptCountOpt = 32,
    max_new_tokens: opt.MaxNewTokensOpt = 256,
    batch_size: opt.BatchSizeOpt = 32,
    format: opt.FormatOpt = None,
    alpaca_template: opt.AlpacaOpt = None,
    objective: opt.ObjectiveOpt = None,
    seed: opt.SeedOpt = 0,
    trust_remote_code: opt.TrustOpt = False,
    json: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    select: opt.SelectOpt = None,
    ignore: opt.IgnoreOpt = None,
) -> None:
    """Check what the fine-tuned model says: generate for held-out prompts, rendered as served, and find answers
    that never stop, echo the prompt, carry template markers, loop, stop short, or equal the base model's."""

    _finish(commands.outputs_paths(**_options(locals())), json, html)


@app.command("demo")
def demo_command() -> None:
    """Show what hf-sanity does on the embedded tiny model: a correct setup, then a broken one."""
    from hf_sanity.drivers.load import quiet_libraries

    quiet_libraries()
    from hf_sanity.demo import run_demo

    raise typer.Exit(run_demo(console))


@app.command("doctor")
def doctor_command(
    runs: opt.RunsArg,
    predictions: opt.PredictionsOpt = None,
    baseline: opt.BaselineOpt = None,
    baseline_kind: opt.BaselineKindOpt = "human",
    plot: opt.CurvesPlotOpt = None,
    json: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    select: opt.SelectOpt = None,
    ignore: opt.IgnoreOpt = None,
) -> None:
    """Post-mortem of finished runs: loss and eval curves, runs compared, eval predictions (per class, against
    a baseline)."""

    _show_progress()
    report = commands.doctor_runs(**_options(locals()), with_plot=html is not None)
    if plot is not None:
        console.print(f"[dim]plot written to {plot}[/dim]")
    _finish(report, json, html)


@app.command("served")
def served_command(
    model: opt.ServedModelOpt,
    base: opt.AdapterBaseOpt,
    adapter: opt.TrainedAdapterOpt,
    dataset: opt.ProbeDatasetOpt = None,
    tokenizer: opt.ServedModelTokenizerOpt = None,
    split: opt.SplitOpt = "train",
    sample: opt.ProbeSampleOpt = 8,
    trust_remote_code: opt.TrustOpt = False,
    json: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    select: opt.SelectOpt = None,
    ignore: opt.IgnoreOpt = None,
) -> None:
    """Check that the served model computes what was trained: base + adapter against the merged model."""

    _finish(commands.served_paths(**_options(locals())), json, html)


@app.command("overfit")
@opt.with_options(opt.protocol_setup, None)
def overfit_command(
    plot: opt.PlotOpt = None,
    trust_remote_code: opt.TrustOpt = False,
    json: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    **given,
) -> None:
    """Overfit a handful of examples of your pipeline: if the loss does not reach near zero, name the broken link."""
    from hf_sanity.protocol import overfit

    _show_progress()
    options, pipeline = commands.protocol_pipeline(
        **given, trust_remote_code=trust_remote_code, command=sys.argv
    )
    _show_progress(lines=True)  # piped: a line per phase from here (bad input before it stays one line)

    report = overfit(pipeline=pipeline, options=options, plot=plot, with_plot=html is not None)
    if plot is not None:
        console.print(f"[dim]plot written to {plot}[/dim]")
    _finish(report, json, html)


@app.command("diagnose")
@opt.with_options(opt.protocol_setup, None)
def diagnose_command(
    repro: opt.ReproOpt = None,
    trust_remote_code: opt.TrustOpt = False,
    json: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    **given,
) -> None:
    """Run the debugging protocol in order (overfit, step-0 loss, shapes and masks, LR range, precision) and stop at
    the first broken layer, with its fix, a single-batch reproduction and the verification checklist."""
    from hf_sanity.protocol import diagnose

    _show_progress()
    options, pipeline = commands.protocol_pipeline(
        **given, trust_remote_code=trust_remote_code, command=sys.argv
    )
    _show_progress(lines=True)  # piped: a line per phase from here (bad input before it stays one line)

    report = diagnose(pipeline=pipeline, options=options, repro=repro, with_plot=html is not None)
    _finish(report, json, html)


# -- your own training command: `hf-sanity run -- CMD`, `hf-sanity preflight -- CMD` (hf_sanity/launch) -------


@app.command("run", context_settings=opt.LAUNCH_CONTEXT)
def run_command(
    command: opt.CommandArg = None,
    abort_on: opt.AbortOnOpt = "never",
    select: opt.SelectOpt = None,
    ignore: opt.IgnoreOpt = None,
    report: opt.RunFolderOpt = None,
    json: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
) -> None:
    """Run your training command with SanityCallback on every Trainer it builds (TRL's and any subclass), in every
    process it starts; then print the report (rank 0's). The exit code is the command's."""
    from hf_sanity.drivers.launched import abort_line, command_line, nothing_checked, watched_line
    from hf_sanity.launch.command import combined, stopping_rules, write_run_folder

    command = command_line(command, "run")
    if abort_on not in ("error", "never"):
        raise UserInputError(f"--abort-on must be error or never, got {abort_on!r}")
    stops = stopping_rules(select, ignore, abort_on)  # an unknown slug fails before the command starts
    if abort_on == "error":  # say which findings stop the run before it starts: errors only
        err_console.print(abort_line(stops), highlight=False, soft_wrap=True, markup=False)
    outcome = _launched(command, mode="run", abort_on=abort_on, select=select, ignore=ignore)
    watched = combined(outcome, command)
    if watched is None:
        err_console.print(
            f"hf-sanity run: {nothing_checked(outcome, 'trained')}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(outcome.code)
    console.print(f"[dim]hf-sanity run: {watched_line(outcome)}[/dim]", highlight=False)
    if report is not None:
        for folder in write_run_folder(report, outcome):
            console.print(f"[dim]run written to {folder} (hf-sanity doctor {folder})[/dim]", highlight=False)
    _finish(watched, json, html, exit=False)
    raise typer.Exit(outcome.code)


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


def _preflight_of_command(command: list[str], given: dict) -> None:
    """`hf-sanity preflight -- CMD`: preflight on the trainer the command builds, where its train() would start
    (``given``: preflight's options as parsed)."""
    from hf_sanity.drivers import launched

    options = launched.preflight_options(given)
    json_path, html_path, rows_path = options.pop("json"), options.pop("html"), options.pop("rows_out")
    outcome = _launched(command, mode="preflight", **options)
    if outcome.code == 130 and not outcome.reports:
        err_console.print("aborted")
        raise typer.Exit(130)
    _finish(launched.preflight_report(outcome, command), json_path, html_path, rows_path)


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
