"""A finished run as Trainer left it on disk, read without running any code of its files, and what it says
about itself.

A RUN is a ``trainer_state.json``, a checkpoint folder that holds one, or a Trainer ``output_dir`` (its own
``trainer_state.json``, written by ``trainer.save_state()``, or the one of its latest ``checkpoint-*``,
whichever has more steps). Beside the state (in its folder, then for a checkpoint in the output_dir above):
``config.json`` gives the model's identity and vocabulary; the arguments come from the ``training_args.bin``
Trainer saves (read inert, see :mod:`hf_sanity.measure.training_args`) and a ``training_args.json`` /
``args.json`` twin, which wins where both give a field. Where SanityCallback watched the run, the findings
of its ``output_dir/hf-sanity/report.json``. Nothing is written into the run folders.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_sanity import report_schema
from hf_sanity.errors import UserInputError
from hf_sanity.measure.curves import Curves
from hf_sanity.measure.training_args import read_training_args_bin
from hf_sanity.report_schema import FindingRecord, ReportRecord

STATE = "trainer_state.json"
ARGS_FILES = ("training_args.json", "args.json")
ARGS_BIN = "training_args.bin"
CALLBACK_REPORT = Path("hf-sanity") / "report.json"  # where SanityCallback writes its report in output_dir
# A PEFT adapter saved beside the state (Trainer's checkpoint of a PeftModel).
ADAPTER_CONFIG = "adapter_config.json"
RUN_HELP = "pass a trainer_state.json, a checkpoint folder or a Trainer output_dir"


@dataclass
class Run:
    """One finished run as read from disk."""

    label: str
    state_path: Path | None  # None: no trainer_state.json, only SanityCallback's report
    state: dict[str, Any]
    curves: Curves
    model_config: dict[str, Any] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # the side files that were read
    callback_report: Path | None = None  # SanityCallback's report.json, when it watched this run
    callback_findings: list[FindingRecord] = field(default_factory=list)  # the findings it holds, as written
    missing: str | None = None  # what could not be read and so was not analysed, in one line
    adapter: bool = False  # a PEFT adapter's config is saved beside the state: the run trained an adapter
    # SanityCallback's digest of the trainable weights at step 0, where it watched the run from its start.
    start_weights: str | None = None

    @property
    def has_loss(self) -> bool:
        return bool(self.curves.train_loss or self.curves.eval_loss)


# -- reading runs ----------------------------------------------------------------------------------
def read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserInputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserInputError(
            f"cannot read {what} {path}: malformed JSON ({exc.msg} at line {exc.lineno}); "
            "restore the file as it was written or remove it"
        ) from None


def _checkpoint_number(path: Path) -> int:
    try:
        return int(path.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def find_state(path: str | Path) -> Path:
    """The trainer_state.json a RUN argument stands for."""
    path = Path(path)
    if not path.exists():
        raise UserInputError(f"run {path} does not exist; {RUN_HELP}")
    if path.is_file():
        return path
    candidates = []
    if (path / STATE).is_file():
        candidates.append(path / STATE)
    checkpoints = sorted(
        (p for p in path.glob("checkpoint-*") if (p / STATE).is_file()), key=_checkpoint_number
    )
    if checkpoints:
        candidates.append(checkpoints[-1] / STATE)
    if not candidates:
        inside = sorted(
            {p.parent.parent if p.parent.name.startswith("checkpoint-") else p.parent
             for p in [*path.glob(f"*/{STATE}"), *path.glob(f"*/checkpoint-*/{STATE}")]}
        )  # fmt: skip
        if inside:
            raise UserInputError(
                f"{path} is not a run but holds {len(inside)} (e.g. {inside[0]}); pass them one by one, "
                f"e.g. `hf-sanity doctor {path}/*`"
            )
        raise UserInputError(
            f"no {STATE} in {path} nor in a checkpoint-* folder under it; {RUN_HELP} "
            "(Trainer writes it with each checkpoint, and at the end with trainer.save_state())"
        )
    if len(candidates) == 1:
        return candidates[0]
    # The top-level file (save_state at the end) unless the latest checkpoint went further.
    steps = [global_step(read_json(c, "trainer state")) for c in candidates]
    return candidates[1] if steps[1] > steps[0] else candidates[0]


def global_step(state: Any) -> int:
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) else -1


def _side_files(state_path: Path) -> list[Path]:
    """Folders whose side files describe the run: the state's folder, then (for a checkpoint) its parent."""
    folder = state_path.parent
    folders = [folder]
    if folder.name.startswith("checkpoint-"):
        folders.append(folder.parent)
    return folders


def _vocab_size(config: dict[str, Any]) -> int | None:
    for source in (config, config.get("text_config") or {}):
        value = source.get("vocab_size") if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return None


def _read_args(folders: list[Path], files: list[str]) -> dict[str, Any]:
    """The training arguments: the first training_args.bin, overlaid by the first JSON args file."""
    pickled: dict[str, Any] = {}
    written: dict[str, Any] = {}
    for folder in folders:
        if not pickled and (folder / ARGS_BIN).is_file():
            pickled = read_training_args_bin(folder / ARGS_BIN) or {}
            if pickled:
                files.append(str(folder / ARGS_BIN))
        for name in ARGS_FILES:
            if not written and (folder / name).is_file():
                data = read_json(folder / name, "training arguments")
                if isinstance(data, dict):
                    written = data
                    files.append(str(folder / name))
    return {**pickled, **written}


def _safeguards(args: dict[str, Any], planned_steps: int | None) -> tuple[float | None, int | None]:
    """(max_grad_norm, warmup steps) as the training arguments give them: clipping is off at 0 or None; warmup
    is a step count, or a fraction of the planned steps (``warmup_steps`` < 1, or ``warmup_ratio``). None
    where the arguments do not say."""
    if "max_grad_norm" not in args:
        return None, None
    clip = args["max_grad_norm"]
    max_grad_norm = float(clip) if isinstance(clip, (int, float)) and not isinstance(clip, bool) else 0.0
    steps, ratio = args.get("warmup_steps"), args.get("warmup_ratio")
    warmup = None
    if isinstance(steps, (int, float)) and steps >= 1:
        warmup = int(steps)
    elif isinstance(steps, (int, float)) and steps > 0 and planned_steps:
        warmup = math.ceil(planned_steps * steps)
    elif isinstance(ratio, (int, float)) and ratio > 0 and planned_steps:
        warmup = math.ceil(planned_steps * ratio)
    elif steps in (0, None) and ratio in (0, None) and ("warmup_steps" in args or "warmup_ratio" in args):
        warmup = 0
    return max_grad_norm, warmup


def _read_callback_report(folders: list[Path]) -> tuple[Path | None, ReportRecord | None]:
    """SanityCallback's report beside the run, read through the report's schema (one of an older version is
    read, its findings of another shape left out and counted; a newer or malformed one is bad input)."""
    for folder in folders:
        path = folder / CALLBACK_REPORT
        if path.is_file():
            return path, report_schema.read(path, "SanityCallback report")
    return None, None


def read_run(path: str | Path) -> Run:
    """Read one RUN: its trainer state, the config.json beside it, its training arguments and the report of
    the SanityCallback that watched it. What is there is read: a run SanityCallback stopped before any step
    was logged (``abort_on="error"``), or one that saved no trainer_state.json, still has the callback's
    report; ``missing`` says what was not there. Nothing at all to read is bad input."""
    try:
        state_path = find_state(path)
    except UserInputError:  # no state: is SanityCallback's report there?
        folder = Path(path)
        if not (folder.is_dir() and (folder / CALLBACK_REPORT).is_file()):
            raise
        state_path, state = None, {"log_history": []}
        missing = (
            f"no {STATE} (the run saved no checkpoint and did not call trainer.save_state()): its curves were "
            "not read"
        )
    else:
        state = read_json(state_path, "trainer state")
        if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
            raise UserInputError(f"{state_path} has no log_history list, so it is not a {STATE}; {RUN_HELP}")
        missing = None
    model_config: dict[str, Any] = {}
    files: list[str] = []
    folders = _side_files(state_path) if state_path is not None else [folder]
    for side in folders:
        config_path = side / "config.json"
        if not model_config and config_path.is_file():
            data = read_json(config_path, "model config")
            if isinstance(data, dict):
                model_config = data
                files.append(str(config_path))
    adapters = [str(side / ADAPTER_CONFIG) for side in folders if (side / ADAPTER_CONFIG).is_file()]
    files += adapters[:1]
    args = _read_args(folders, files)
    callback_report, callback_record = _read_callback_report(folders)
    if callback_report is not None:
        files.append(str(callback_report))
    curves = Curves.from_log_history(state["log_history"], vocab_size=_vocab_size(model_config))
    max_steps = state.get("max_steps")
    curves.planned_steps = max_steps if isinstance(max_steps, int) and max_steps > 0 else None
    curves.max_grad_norm, curves.warmup_steps = _safeguards(args, curves.planned_steps)
    if state_path is not None and not curves.train_loss and not curves.eval_loss:
        no_loss = f"{state_path} logs no loss (log_history has no 'loss' nor 'eval_loss' entry)"
        if callback_report is None and not _counted(state):
            raise UserInputError(
                f"{no_loss}; train with logging_steps set so that at least one step is logged"
            )
        missing = f"{no_loss}: its curves were not analysed"
    if callback_record is not None and callback_record.left_out:
        left_out = (
            f"{callback_record.left_out} finding(s) of {callback_report} have a shape this hf-sanity does not "
            "know (an older one wrote the file) and were left out"
        )
        missing = f"{missing}; {left_out}" if missing else left_out
    return Run(
        str(path), state_path, state, curves, model_config, args, files, callback_report,
        callback_record.findings if callback_record is not None else [],
        missing, bool(adapters), _start_weights(callback_record),
    )  # fmt: skip


def _start_weights(record: ReportRecord | None) -> str | None:
    value = record.stats.get("start_weights") if record is not None else None
    return value if isinstance(value, str) else None


def _counted(state: dict[str, Any]) -> bool:
    """Whether SanityCallback logged a count of its findings into the state's log_history."""
    return any(
        isinstance(entry, dict) and any(key.startswith("hf_sanity/") for key in entry)
        for entry in state["log_history"]
    )


# -- predictions -----------------------------------------------------------------------------------
def read_predictions(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a predictions JSONL: {"prediction": ..., "label": ...} and/or {"score": ...}."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(
            f"predictions file {path} does not exist; pass a JSONL of "
            '{"prediction": ..., "label": ...} and/or {"score": ...} rows'
        )
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserInputError(f"cannot read predictions file {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserInputError(
                f"cannot read predictions file {path}: line {number} is not JSON ({exc.msg}); "
                'each line must be an object like {"prediction": "yes", "label": "no"} or {"score": 4}'
            ) from None
        if not isinstance(row, dict):
            raise UserInputError(
                f"predictions file {path}: line {number} is not a JSON object; "
                'each line must be an object like {"prediction": "yes", "label": "no"} or {"score": 4}'
            )
        rows.append(row)
    if not any(("prediction" in r and "label" in r) or "score" in r for r in rows):
        raise UserInputError(
            f"predictions file {path} has no row with both 'prediction' and 'label', nor with 'score'; "
            "write one JSON object per line with those keys"
        )
    return rows


def label_key(value: Any) -> str:
    """A prediction or label as compared: strings stripped, integral floats as ints, the rest as JSON."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True)


PER_CLASS_MAX = 50  # labels with more values than this are free text: no per-class table


def class_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Per label of the predictions' rows (prediction and label): its support, the accuracy on it (recall),
    how often it was predicted, and what it is most often mistaken for; by support, largest first. None
    without labelled predictions or with free-text labels (more than ``PER_CLASS_MAX`` values)."""
    from collections import Counter

    pairs = [
        (label_key(r["prediction"]), label_key(r["label"]))
        for r in rows
        if "prediction" in r and "label" in r
    ]
    labels = Counter(y for _, y in pairs)
    if not pairs or len(labels) > PER_CLASS_MAX:
        return None
    predicted = Counter(p for p, _ in pairs)
    wrong: dict[str, Counter] = {}
    for p, y in pairs:
        if p != y:
            wrong.setdefault(y, Counter())[p] += 1
    table = []
    for label, support in labels.most_common():
        mistaken = wrong.get(label, Counter()).most_common(1)
        table.append(
            {
                "label": label,
                "support": support,
                "accuracy": round((support - sum(wrong.get(label, Counter()).values())) / support, 4),
                "predicted": predicted.get(label, 0),
                "most_confused_with": mistaken[0][0] if mistaken else None,
                "confused": mistaken[0][1] if mistaken else 0,
            }
        )
    return table


# -- what a run says about itself ------------------------------------------------------------------
# A run's readable description is split in two. HYPERPARAMETERS are the knobs people turn between runs
# of one setup; everything else that is readable (the model's identity from config.json, the other fields
# of the training arguments) is the SETUP. BOOKKEEPING fields (where a run writes, how it is named, logged,
# evaluated or reported) are neither. Runs "differ only in hyperparameters" when no setup field readable in
# both differs: a field one run does not record is unknown and does not separate them, so bare
# trainer_state.json files passed together are taken as one setup (the evidence lists what was compared).
HYPERPARAMETERS = frozenset(
    {
        "learning_rate", "lr", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
        "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim", "optim_args",
        "num_train_epochs", "epochs", "max_steps", "per_device_train_batch_size", "train_batch_size",
        "batch_size", "gradient_accumulation_steps", "seed", "data_seed", "full_determinism",
        "label_smoothing_factor", "neftune_noise_alpha", "lora_r", "r", "lora_alpha", "lora_dropout",
        "dropout", "bf16", "fp16", "tf32", "mixed_precision", "gradient_checkpointing", "logging_steps",
        "eval_steps", "save_steps", "eval_strategy", "save_strategy", "logging_strategy", "peak_learning_rate",
    }
)  # fmt: skip
BOOKKEEPING_PREFIXES = (
    "output_dir", "logging_", "log_", "run_name", "project", "trackio_", "report_to", "hub_", "push_to_hub",
    "overwrite_output_dir", "resume_from_checkpoint", "disable_tqdm", "local_rank", "dataloader_", "save_",
    "eval_", "per_device_eval_batch_size", "prediction_loss_only", "include_", "batch_eval_metrics",
    "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "ignore_data_skip",
    "restore_callback_states", "skip_memory_metrics", "do_train", "do_eval", "do_predict", "debug",
    "distributed_state", "deepspeed_plugin", "_", "ddp_", "fsdp",
)  # fmt: skip
# Fields of config.json that do not tell one model from another: written by the library for this run (its
# version, the dtype the weights were saved in, the cache switch). The rest is the model's identity (two
# checkpoints of one architecture differ in their token ids, rope, ...), but dropout is a hyperparameter.
CONFIG_NOT_IDENTITY = frozenset(
    {
        "transformers_version", "dtype", "torch_dtype", "use_cache", "_attn_implementation",
        "attn_implementation", "_commit_hash", "output_attentions", "output_hidden_states", "return_dict",
    }
)  # fmt: skip
# Fields of trainer_state.json that are hyperparameters.
STATE_HYPERPARAMETERS = ("train_batch_size", "max_steps", "num_train_epochs", "logging_steps", "eval_steps")


def _is_dropout(key: str) -> bool:
    return "dropout" in key or key.endswith("_pdrop")


@dataclass
class RunDescription:
    label: str
    setup: dict[str, Any]
    hyperparameters: dict[str, Any]
    curves: Curves
    objective: str = "sft"  # the objective's kind (`measure.objective`): runs are compared within one kind
    adapter: bool = False  # it trained a PEFT adapter (its config saved beside the state)
    start_weights: str | None = None  # the digest of its trainable weights at step 0 (SanityCallback's)

    @property
    def learning_rate(self) -> tuple[float | None, str | None]:
        """(the learning rate the run was configured with, where it was read): the training arguments'
        ``learning_rate`` (or ``lr``), else the peak of the logged LR. Never the first logged one, which a
        warmup starts near 0."""
        for key in ("learning_rate", "lr"):
            value = self.hyperparameters.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value), "arguments"
        peak = self.hyperparameters.get("peak_learning_rate")
        return (float(peak), "peak of the logged LR") if peak is not None else (None, None)


def series(descriptions: list[RunDescription]) -> list[list[int]]:
    """The runs' indices grouped by objective, each group in the order given: a DPO run and a GRPO run are not
    one series of tries (what changed between them is the whole method)."""
    groups: dict[str, list[int]] = {}
    for i, description in enumerate(descriptions):
        groups.setdefault(description.objective, []).append(i)
    return list(groups.values())


def canonical(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str)


def describe(run: Run, objective: str = "sft") -> RunDescription:
    """Split what a run records (``run.state``, ``run.model_config``, ``run.args``, ``run.curves``) into
    setup and hyperparameters; ``objective``: the kind of objective it trained for."""
    setup: dict[str, Any] = {}
    hyper: dict[str, Any] = {}
    for key, value in run.model_config.items():
        if key in CONFIG_NOT_IDENTITY:
            continue
        (hyper if _is_dropout(key) else setup)[f"model.{key}"] = value
    for key, value in run.args.items():
        if key in HYPERPARAMETERS:
            hyper[key] = value
        elif not key.startswith(BOOKKEEPING_PREFIXES):
            setup[key] = value
    for key in STATE_HYPERPARAMETERS:
        value = run.state.get(key)
        if value is not None:
            hyper.setdefault(key, value)
    lrs = [lr for lr in run.curves.lr if math.isfinite(lr)]
    if lrs:
        hyper["peak_learning_rate"] = float(f"{max(lrs):.6g}")
    return RunDescription(run.label, setup, hyper, run.curves, objective, run.adapter, run.start_weights)


@dataclass
class RunSet:
    """What the run rules read: each run's description, the failures its own curves showed (slugs of its
    error and warning findings), and the eval predictions when given."""

    descriptions: list[RunDescription]
    failures: list[frozenset[str]]
    predictions: list[dict[str, Any]] | None = None
    # The accuracy the predictions are judged against (doctor --baseline), and whose: "human" (a model above
    # it is suspect) or "majority" (a model not above it learned nothing).
    baseline: float | None = None
    baseline_kind: str = "human"


# -- what changed from one run to the next ---------------------------------------------------------
# One knob can be recorded under several names (a Trainer argument, the same number in trainer_state.json,
# the peak LR read from the logs; max_steps and the epochs Trainer derives from it): each group is one
# setting, so that changing the batch size is one change, not two. A new model is one change too.
SETTING_OF = {
    **dict.fromkeys(("learning_rate", "lr", "peak_learning_rate"), "learning rate"),
    **dict.fromkeys(("per_device_train_batch_size", "train_batch_size", "batch_size"), "batch size"),
    **dict.fromkeys(("max_steps", "num_train_epochs", "epochs"), "training length"),
    **dict.fromkeys(("warmup_steps", "warmup_ratio"), "warmup"),
    **dict.fromkeys(("lora_r", "r"), "LoRA rank"),
    **dict.fromkeys(("bf16", "fp16", "tf32", "mixed_precision"), "precision"),
    **dict.fromkeys(("seed", "data_seed", "full_determinism"), "seed"),
}
# How often a run logs, evaluates or saves changes nothing it learns.
NOT_A_SETTING = frozenset(
    {"logging_steps", "eval_steps", "save_steps", "eval_strategy", "save_strategy", "logging_strategy"}
)
PEAK_LR_TOLERANCE = 0.05  # the peak LR read from the logs depends on which steps were logged


@dataclass
class Change:
    """One setting that differs between a run and the one before it: each field it is recorded under, as
    [before, after]; ``kind``: hyperparameter, or setup (the model, or any other readable argument)."""

    setting: str
    kind: str
    fields: dict[str, list[Any]]

    def describe(self) -> str:
        """``learning rate 0.0001 → 0.0003``; a model by its name where that changed."""
        before, after = self.fields.get("model._name_or_path") or next(iter(self.fields.values()))
        return f"{self.setting} {_short_value(before)} → {_short_value(after)}"


def _short_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _peak_lr_differs(a: Any, b: Any) -> bool:
    if not all(isinstance(v, (int, float)) for v in (a, b)):
        return canonical(a) != canonical(b)
    return abs(a - b) > PEAK_LR_TOLERANCE * max(abs(a), abs(b))


def changes(before: RunDescription, after: RunDescription) -> list[Change]:
    """The settings readable in both runs that differ, one :class:`Change` per setting (a field one of them
    does not record is unknown, not a change). The peak LR of the logs stands in for the learning rate only
    where neither run records the argument."""
    found: dict[str, Change] = {}
    recorded_lr = any(
        k in before.hyperparameters and k in after.hyperparameters for k in ("learning_rate", "lr")
    )
    for kind, a, b in (
        ("setup", before.setup, after.setup),
        ("hyperparameter", before.hyperparameters, after.hyperparameters),
    ):
        for key in sorted(a.keys() & b.keys()):
            if key in NOT_A_SETTING or (key == "peak_learning_rate" and recorded_lr):
                continue
            differs = (
                _peak_lr_differs(a[key], b[key])
                if key == "peak_learning_rate"
                else canonical(a[key]) != canonical(b[key])
            )
            if not differs:
                continue
            setting = "model" if kind == "setup" and key.startswith("model.") else SETTING_OF.get(key, key)
            change = found.setdefault(setting, Change(setting, kind, {}))
            change.fields[key] = [a[key], b[key]]
    return sorted(found.values(), key=lambda c: (c.kind != "hyperparameter", c.setting))
