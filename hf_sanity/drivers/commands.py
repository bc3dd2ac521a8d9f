"""What each command of the CLI runs on the paths it was given: the options checked, the setup loaded once
(:mod:`hf_sanity.drivers.load`), the checks run, a repaired copy written. The CLI parses, calls these and
renders what they return; every option that shapes the checks goes through here, by name.

Imports at module level stay light: bad options and bad paths are reported before torch, transformers or
datasets are imported.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hf_sanity.drivers import load
from hf_sanity.errors import UserInputError

# `hf-sanity fix`'s options that shape the checks, at their defaults: the fix hint under a preflight report
# names those preflight ran with that differ, so that the fix checks the run preflight checked.
FIX_DEFAULTS = {"tokenizer": None, "split": "train", "eval_dataset": None, "eval_split": None, "max_len": None,
                "loss_on": None, "format": None, "alpaca_template": None, "task": "generative", "adapter": None,
                "inference_tokenizer": None, "sample": 256, "select": None, "ignore": None,
                "trust_remote_code": False, "num_proc": None}  # fmt: skip


def shaping(given: dict) -> dict:
    """The paths and the options that shape the checks, of preflight's or fix's options as parsed."""
    return {name: given[name] for name in ("model", "dataset", *FIX_DEFAULTS)}


def check_format(format: str | None) -> None:
    if format is not None:
        from hf_sanity.measure.formats import FORMATS

        if format not in FORMATS:
            raise UserInputError(f"unknown --format {format!r}; use one of {', '.join(FORMATS)}")


def check_preflight(
    *, select, ignore, loss_on, max_len, sample, alpaca_template, task, show, format, num_proc, eval_dataset,
    eval_split, **_,
) -> bool:  # fmt: skip
    """Preflight's (and fix's) options, checked in a blink before anything is imported or loaded; whether the
    checks read the model's weights (with the model stage off, the folder needs none)."""
    from hf_sanity.drivers.preflight import check_options, reads_model
    from hf_sanity.selection import resolve

    weights = reads_model(resolve(select, ignore))
    check_options(loss_on=loss_on, max_len=max_len, sample=sample, alpaca_template=alpaca_template, task=task)
    if show is not None and show < 1:
        raise UserInputError(f"--show takes a number of rows (1 or more), got {show}")
    check_format(format)
    if num_proc is not None and num_proc < 1:
        raise UserInputError(f"--num-proc must be at least 1, got {num_proc}")
    if eval_dataset and eval_split:
        raise UserInputError("pass --eval-dataset or --eval-split, not both")
    return weights


def user_paths(model, dataset, *, tokenizer=None, eval_dataset=None, adapter=None, inference_tokenizer=None,
               **_) -> tuple:  # fmt: skip
    """The user's own paths, which a repaired copy may not be written into."""
    return (model, tokenizer, dataset, eval_dataset, adapter, inference_tokenizer)


def check_fix_out(out: Path | None, diff: bool, yours) -> None:
    """The folder for the repaired copy is given, new or empty, and none of the user's (before any loading)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserInputError("fix runs in one process: run it without torchrun or accelerate launch")
    if diff:
        return
    if out is None:
        raise UserInputError("--fix needs --fix-out DIR: a new folder for the repaired copy")
    from hf_sanity.drivers.fix import check_out

    check_out(out, protect=yours)


def fix_command_line(model: str, dataset: str, **options) -> str:
    """`hf-sanity fix` with the options preflight ran with that change what is checked (those at `fix`'s own
    default left out)."""
    import shlex

    args = ["hf-sanity", "fix", "--model", model, "--dataset", dataset]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if name not in FIX_DEFAULTS:
            raise TypeError(f"`hf-sanity fix` has no {flag}")  # a preflight option fix does not pass on
        if value is None or value is False or value == FIX_DEFAULTS[name]:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            args += [a for v in value for a in (flag, str(v))]
        else:
            args += [flag, str(value)]
    return " ".join(shlex.quote(a) for a in args) + " --out DIR"


def preflight_paths(
    model: str | None, dataset: str | None, *, tokenizer=None, split="train", eval_dataset=None, eval_split=None,
    max_len=None, adapter=None, inference_tokenizer=None, loss_on=None, format=None, alpaca_template=None,
    task="generative", sample=256, num_proc=None, trust_remote_code=False, select=None, ignore=None, show=None, fix=False,
    fix_out=None, diff=False,
):  # fmt: skip
    """Preflight on the setup at these paths: (the report, the inputs it checked, for a fix). Every option is
    checked first (``fix``: the folder for the repaired copy, ``fix_out``, too; none with ``diff``). Rows with
    pictures on a vision-language model go to TRL's trainer (then the inputs are None: no fix for them yet)."""
    for flag, value in (("--model", model), ("--dataset", dataset)):
        if value is None:
            raise UserInputError(
                f"Missing option '{flag}' (or check your training command's own trainer: `hf-sanity preflight -- "
                "CMD`; see hf-sanity preflight --help)"
            )
    given = dict(locals())
    weights = check_preflight(**given)
    if fix:
        check_fix_out(fix_out, diff, user_paths(**given))
    load.check_paths(model, dataset, tokenizer=tokenizer, weights=weights, eval_dataset=eval_dataset,
                     inference_tokenizer=inference_tokenizer)  # fmt: skip
    load.quiet_libraries()
    from hf_sanity.drivers.preflight import preflight

    setup = load.from_paths(
        model, dataset, tokenizer=tokenizer, split=split, eval_dataset=eval_dataset, eval_split=eval_split,
        adapter=adapter, inference_tokenizer=inference_tokenizer, trust_remote_code=trust_remote_code,
        weights=weights, vision=True,
    )  # fmt: skip
    if setup.processor is not None:  # vision-language rows on a model with an image processor
        if fix:
            raise UserInputError(
                "--fix does not repair vision-language data yet; run preflight without --fix"
            )
        report = preflight_vlm(setup, dataset, max_len=max_len, loss_on=loss_on, adapter=adapter, sample=sample,
                               select=select, ignore=ignore, show=show)  # fmt: skip
        return report, None
    inputs = dict(
        model=setup.load_model if weights else None, model_config=setup.config,
        generation_config=setup.generation_config(), tokenizer=setup.tokenizer, dataset=setup.dataset,
        eval_dataset=setup.eval_dataset, max_len=max_len, loss_on=loss_on, format=format,
        alpaca_template=alpaca_template, task=task, adapter=adapter, inference_tokenizer=setup.inference_tokenizer,
        sample=sample, num_proc=num_proc, select=select, ignore=ignore, show=show,
    )  # fmt: skip
    report = preflight(**inputs)
    _with_load_time(report, setup.seconds)
    # the hint under the report: `hf-sanity fix` with the options that change what is checked (not --num-proc)
    report.fix_command = fix_command_line(
        model, dataset, **{name: given[name] for name in FIX_DEFAULTS if name != "num_proc"}
    )
    return report, inputs


def _with_load_time(report, seconds: float) -> None:
    """Config, tokenizer and data loading come first, then preflight's own phases."""
    phases = report.stats.get("seconds_by_phase")
    if phases is not None:
        report.stats["seconds_by_phase"] = {"load": round(seconds, 2), **phases}


def preflight_vlm(
    setup: load.Setup, dataset: str, *, max_len, loss_on, adapter, sample, select, ignore, show
):
    """preflight(trainer=) on TRL's SFTTrainer built from the model folder (with --adapter, the saved adapter on
    it), its processor and the rows whose picture paths are read relative to the data file; the trainer's
    output folder is a temporary one."""
    import time

    from hf_sanity.drivers.preflight import preflight
    from hf_sanity.drivers.vlm import data_folder, vlm_trainer, with_pictures

    started = time.perf_counter() - setup.seconds
    data = with_pictures(setup.dataset, setup.pictures, data_folder(dataset), dataset)
    with tempfile.TemporaryDirectory(prefix="hf-sanity-vlm-") as scratch:
        trainer = vlm_trainer(
            setup.model_ref, setup.processor, data, max_len=max_len, loss_on=loss_on, output_dir=scratch,
            adapter=adapter, trust_remote_code=setup.trust_remote_code,
        )  # fmt: skip
        loaded = time.perf_counter() - started
        report = preflight(
            trainer=trainer, dataset=data, sample=sample, select=select, ignore=ignore, show=show
        )
    _with_load_time(report, loaded)
    return report


def fix_setup(report, inputs: dict, *, unsafe: bool, dataset: str):
    """The remedies of ``report`` applied to a copy of ``inputs`` and checked (:class:`~hf_sanity.drivers.fix.
    Fixed`); the repaired data is written in the format of ``dataset``."""
    from hf_sanity import progress
    from hf_sanity.drivers.fix import fix

    with progress.phase("fixing a copy and checking it again"):
        return fix(report=report, unsafe=unsafe, use_config=True, data_format=load.data_format(dataset),
                   **inputs)  # fmt: skip


def save_fixed(fixed, out: Path, *, model: str, protect) -> str:
    """The repaired copy written to ``out`` (the model's unchanged files linked): the line that says what was
    written."""
    folder = load.model_files(model)
    where = fixed.save(out, model_folder=folder, protect=protect)
    return fixed.saved_summary(where, folder)


def write_fixes(fixed, path: Path) -> None:
    """What changed and the outcomes, as JSON."""
    import json

    from hf_sanity.report import write_atomic

    write_atomic(path, json.dumps(fixed.to_dict(), indent=2, ensure_ascii=False) + "\n")


def show_paths(model: str, dataset: str, *, tokenizer=None, split="train", rows=None, trainer_batch=False,
               max_len=None, loss_on=None, format=None, alpaca_template=None, trust_remote_code=False):  # fmt: skip
    """`show` on the setup at these paths (the weights loaded only for the trainer's batch)."""
    from hf_sanity.drivers.preflight import check_options
    from hf_sanity.drivers.show import parse_rows

    picked = parse_rows(rows)
    check_options(loss_on=loss_on, max_len=max_len, alpaca_template=alpaca_template)
    load.check_paths(model, dataset, tokenizer=tokenizer, weights=trainer_batch)
    load.quiet_libraries()
    from hf_sanity.drivers.show import show

    setup = load.from_paths(model, dataset, tokenizer=tokenizer, split=split, weights=trainer_batch,
                            trust_remote_code=trust_remote_code)  # fmt: skip
    return show(
        model=setup.load_model if trainer_batch else None, tokenizer=setup.tokenizer, dataset=setup.dataset,
        rows=picked, trainer_batch=trainer_batch, max_len=max_len, loss_on=loss_on, format=format,
        alpaca_template=alpaca_template, source=dataset,
    )  # fmt: skip


def outputs_paths(model: str, dataset: str, *, adapter=None, base=None, tokenizer=None, inference_tokenizer=None,
                  split=None, trust_remote_code=False, **options):  # fmt: skip
    """`outputs` on the model at these paths and its held-out prompts (``options``: outputs()'s)."""
    from hf_sanity.drivers.outputs import check_options
    from hf_sanity.selection import resolve

    resolve(options.get("select"), options.get("ignore"))  # bad options fail before anything is loaded
    check_options(n=options["n"], max_new_tokens=options["max_new_tokens"], batch_size=options["batch_size"],
                  alpaca_template=options["alpaca_template"], objective=options["objective"])  # fmt: skip
    check_format(options.get("format"))
    load.check_paths(model, dataset, tokenizer=tokenizer, inference_tokenizer=inference_tokenizer, base=base)
    load.quiet_libraries()
    from hf_sanity.drivers.outputs import outputs
    from hf_sanity.measure.sources import load_model

    setup = load.from_paths(model, dataset, tokenizer=tokenizer, split=split, adapter=adapter,
                            inference_tokenizer=inference_tokenizer, trust_remote_code=trust_remote_code,
                            held_out=True)  # fmt: skip
    fine_tuned = setup.load_model()
    base_model = None
    if base is not None:
        same = adapter is not None and Path(base).expanduser().resolve() == Path(model).expanduser().resolve()
        base_model = fine_tuned if same else load_model(base, trust_remote_code=trust_remote_code)
    return outputs(model=fine_tuned, tokenizer=setup.tokenizer, dataset=setup.dataset, adapter=adapter,
                   base=base_model, inference_tokenizer=setup.inference_tokenizer, **options)  # fmt: skip


def doctor_runs(runs, *, predictions=None, baseline=None, baseline_kind="human", plot=None, select=None,
                ignore=None, with_plot=False):  # fmt: skip
    """`doctor` on the finished runs at these paths (``with_plot``: the figures kept for the HTML page)."""
    from hf_sanity.drivers.doctor import check_baseline
    from hf_sanity.selection import resolve

    resolve(select, ignore)  # an unknown slug fails before anything is read
    check_baseline(baseline, baseline_kind, predictions)
    load.quiet_libraries()
    from hf_sanity.drivers.doctor import doctor

    return doctor(runs, predictions=predictions, select=select, ignore=ignore, plot=plot, with_plot=with_plot,
                  baseline=baseline, baseline_kind=baseline_kind)  # fmt: skip


def served_paths(model: str, *, base: str, adapter: str, dataset=None, tokenizer=None, split="train", sample=8,
                 trust_remote_code=False, select=None, ignore=None):  # fmt: skip
    """`served` on the merged model at ``model`` against ``base`` with ``adapter`` attached."""
    from hf_sanity.selection import resolve

    resolve(select, ignore)
    if sample < 1:
        raise UserInputError(f"--sample must be at least 1, got {sample}")
    state = load.check_adapter(adapter)  # an unreadable adapter fails before a model is loaded
    load.check_paths(model, dataset, tokenizer=tokenizer, base=base)
    load.quiet_libraries()
    from hf_sanity.drivers.served import served
    from hf_sanity.measure.adapters import fit_to_adapter
    from hf_sanity.measure.sources import load_model

    setup = load.from_paths(model, dataset, tokenizer=tokenizer, split=split, base=base,
                            trust_remote_code=trust_remote_code)  # fmt: skip
    served_model = setup.load_model()
    base_model = load_model(base, dtype=served_model.dtype, trust_remote_code=trust_remote_code)
    fit_to_adapter(base_model, state)  # tokens added for training: the base resized as it was then
    return served(served_model, base=base_model, adapter=adapter, tokenizer=setup.tokenizer,
                  dataset=setup.dataset, sample=sample, select=select, ignore=ignore)  # fmt: skip


def protocol_pipeline(*, model, dataset, tokenizer, split, adapter_config, lora_r, lora_alpha, lora_target,
                      trust_remote_code, command, **protocol):  # fmt: skip
    """overfit's and diagnose's options (``protocol``: :class:`~hf_sanity.protocol.options.ProtocolOptions`'),
    checked before anything is imported or loaded, and the pipeline they train on, loaded from the paths."""
    from hf_sanity import progress
    from hf_sanity.protocol.options import ProtocolOptions

    options = ProtocolOptions(**protocol)
    load.check_paths(model, dataset, tokenizer=tokenizer)
    with progress.phase("importing torch and transformers"):  # on screen before the slow imports, not after
        load.quiet_libraries()
        import torch  # noqa: F401

        from hf_sanity.protocol.build import from_paths
    return options, from_paths(
        model, dataset, options=options, tokenizer=tokenizer, split=split, adapter_config=adapter_config,
        lora_r=lora_r, lora_alpha=lora_alpha, lora_target=lora_target, trust_remote_code=trust_remote_code,
        command=command,
    )  # fmt: skip
