"""`hf-sanity run -- CMD` and `hf-sanity preflight -- CMD`: the options checked before the command starts, what its
outcome says in one line, and preflight's report of the trainer it built (hf_sanity/launch runs the command)."""

from __future__ import annotations

from hf_sanity.errors import UserInputError

EXAMPLE_STOPS = ("nonfinite-loss", "loss-diverged", "truncated-completion", "reward-function-broken")
# preflight's options that describe a setup to load, and their defaults: with -- CMD the trainer is read instead
SETUP_OPTIONS = {"model": None, "dataset": None, "tokenizer": None, "split": "train", "eval_dataset": None,
                 "eval_split": None, "max_len": None, "adapter": None, "inference_tokenizer": None,
                 "loss_on": None, "format": None, "alpaca_template": None, "task": "generative",
                 "num_proc": None, "trust_remote_code": False, "fix": False, "fix_out": None,
                 "unsafe_fixes": False}  # fmt: skip
COMMAND_OPTIONS = ("select", "ignore", "sample", "show", "json", "html", "rows_out")


def command_line(command: list[str] | None, name: str) -> list[str]:
    if not command:
        raise UserInputError(
            f"pass your training command after --, e.g. `hf-sanity {name} -- trl sft --model_name_or_path ...`"
        )
    return list(command)


def abort_line(stops: list[str]) -> str:
    """What `run --abort-on error` stops on, said before the command starts."""
    if not stops:
        return "hf-sanity run: --abort-on error, but no rule of severity error is selected: nothing will stop the run"
    examples = [s for s in EXAMPLE_STOPS if s in stops] or stops[:4]
    return (
        "hf-sanity run: --abort-on error: training stops after the step of the first finding of severity error "
        f"(e.g. {', '.join(examples)}; `hf-sanity rules` lists each rule's severity, [tool.hf-sanity] severity "
        "changes it); warnings and info never stop it"
    )


def watched_line(outcome) -> str:
    trainers = [record.get("trainer") for record, _ in outcome.reports]
    processes = len({a.get("pid") for a in outcome.attached}) or 1
    ranks = sorted({a.get("rank") for a in outcome.attached if isinstance(a.get("rank"), int)})
    where = f"{processes} processes (ranks {', '.join(map(str, ranks))}); the report is rank 0's" if len(ranks) > 1 \
        else "1 process" if processes == 1 else f"{processes} processes"  # fmt: skip
    what = trainers[0] if len(trainers) == 1 else f"{len(trainers)} trainers ({', '.join(trainers)})"
    return f"SanityCallback watched {what} in {where}; the command exited with {outcome.code}"


def nothing_checked(outcome, verb: str) -> str:
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


def preflight_options(given: dict) -> dict:
    """`hf-sanity preflight -- CMD`'s options (``given``: preflight's as parsed), checked before the command
    starts: none that describes a setup to load."""
    loads = [f"--{k.replace('_', '-')}" for k, default in SETUP_OPTIONS.items() if given[k] != default]
    if loads:
        raise UserInputError(
            f"{', '.join(loads)} describe(s) a setup to load; with -- CMD the checks read the trainer your command "
            "builds: pass one or the other"
        )
    options = {k: given[k] for k in COMMAND_OPTIONS}
    if options["show"] is not None and options["show"] < 1:
        raise UserInputError(f"--show takes a number of rows (1 or more), got {options['show']}")
    if options["sample"] < 1:
        raise UserInputError(f"--sample must be at least 1, got {options['sample']}")
    from hf_sanity.selection import resolve

    resolve(options["select"], options["ignore"])  # an unknown slug fails before the command starts
    return options


def preflight_report(outcome, command: list[str]):
    """The report of the trainer(s) the command built; bad input when there is none."""
    failed = next((f for f in outcome.failures if f.get("input")), None) or next(iter(outcome.failures), None)
    if failed is not None and not outcome.reports:
        raise UserInputError(
            f"preflight could not check the command's {failed.get('trainer')}: {failed['message']}"
        )
    if not outcome.reports:
        raise UserInputError(nothing_checked(outcome, "started training"))
    from hf_sanity.launch.command import combined

    return combined(outcome, command)
