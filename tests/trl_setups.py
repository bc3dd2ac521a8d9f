"""TRL's preference and RL trainers on the tiny model, as a user builds them: the model saved to a folder and
loaded from it (TRL reloads the reference from the model's path), a few steps on the CPU."""

from __future__ import annotations

import contextlib
import importlib
import warnings
from pathlib import Path

import datasets
import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hf_sanity.testing import tiny_model_dir

warnings.filterwarnings("ignore", message=".*padding-free.*")

# The TRL these tests are written against (pyproject's dev extra installs it). An older TRL that lacks a trainer,
# or cannot import it, skips the tests that build one (CI's lower lane); under this one it is a failure.
NEWEST_TRL = "1.16"


def trl_masks_the_prompt() -> bool:
    """TRL 0.24 under transformers 5 trains the prompt of conversational prompt-completion rows although
    completion_only_loss=True: it reads ``apply_chat_template(prompt, tokenize=True)`` as a list of ids, and
    transformers 5 returns a dict there, so the completion mask starts 2 tokens in (its warning: "Mismatch between
    tokenized prompt and the start of tokenized prompt+completion")."""
    import transformers
    import trl
    from packaging.version import Version

    return Version(trl.__version__) < Version("0.25") and Version(transformers.__version__) >= Version("5")


def skip_where_trl_trains_the_prompt() -> None:
    """Skip a test of a clean SFT run on conversational prompt-completion rows where TRL trains their prompt
    (:func:`trl_masks_the_prompt`): not clean there (`prompt-in-loss` says so, tests/test_callback_clean.py)."""
    import transformers
    import trl

    if trl_masks_the_prompt():
        pytest.skip(f"TRL {trl.__version__} under transformers {transformers.__version__} trains the prompt of "
                    "conversational prompt-completion rows")  # fmt: skip


def trl_template(name: str) -> str:
    """The text of TRL's chat template ``name``.jinja (its library of originals and training twins), or the test
    skipped, naming TRL's version, where an older TRL does not ship it (TRL 0.24 ships none)."""
    import trl
    from packaging.version import Version

    path = Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        if Version(trl.__version__) >= Version(NEWEST_TRL):
            raise FileNotFoundError(path)
        pytest.skip(f"TRL {trl.__version__} ships no chat template {name}.jinja")
    return path.read_text(encoding="utf-8")


def from_trl(module: str, *names: str) -> tuple:
    """``names`` from TRL's ``module``, or the test skipped, naming the versions, where an older TRL lacks them or
    cannot import them (TRL 0.24 under transformers 5: its trainers but SFT's import ``mergekit``, because
    transformers 5's ``_is_package_available`` returns a tuple, which TRL 0.24 reads as true)."""
    import transformers
    import trl
    from packaging.version import Version

    try:
        found = importlib.import_module(module)
        return tuple(getattr(found, name) for name in names)
    except (ImportError, AttributeError, RuntimeError) as exc:
        if Version(trl.__version__) >= Version(NEWEST_TRL):
            raise
        why = str(exc).strip().splitlines()[-1]
        pytest.skip(
            f"TRL {trl.__version__} (transformers {transformers.__version__}) has no {module}.{names[0]}: {why}"
        )


def skip_without_config_field(config_cls, field: str, feature: str) -> None:
    """Skip a test of ``feature`` where the installed TRL's ``config_cls`` has no ``field`` (an older TRL, CI's
    lower lane), naming TRL's version and the missing field; under the TRL these tests are written against, a
    missing field is a failure, never a skip."""
    import dataclasses

    import trl
    from packaging.version import Version

    if field in {f.name for f in dataclasses.fields(config_cls)}:
        return
    if Version(trl.__version__) >= Version(NEWEST_TRL):
        raise AssertionError(f"TRL {trl.__version__}'s {config_cls.__name__} has no {field}")
    pytest.skip(f"TRL {trl.__version__}'s {config_cls.__name__} has no {field}: {feature}")


def folder(template: str = "chatml") -> Path:
    return tiny_model_dir(template, "distinct")


def tokenizer(template: str = "chatml"):
    return AutoTokenizer.from_pretrained(folder(template))


def common(tmp_path, **overrides) -> dict:
    """What every setup here shares: short, fp32, no checkpoints, a log every step."""
    return {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "bf16": False,
        "gradient_checkpointing": False,
        "learning_rate": 1e-3,
        "max_length": 256,
        "seed": 0,
        **overrides,
    }


def build(trainer_cls, config_cls, tmp_path, rows, *, callbacks=(), model=None, template="chatml", **config):
    """``trainer_cls`` on the tiny model loaded from its folder, over ``rows``, with ``common`` settings."""
    model = model if model is not None else AutoModelForCausalLM.from_pretrained(folder(template))
    extra = {"peft_config": config.pop("peft_config")} if "peft_config" in config else {}
    args = config_cls(**common(tmp_path, **config))
    with built_by_an_older_trl(trainer_cls):
        return trainer_cls(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer(template),
            callbacks=list(callbacks),
            **extra,
        )


@contextlib.contextmanager
def built_by_an_older_trl(trainer_cls):
    """The test skipped, naming the versions, where an older TRL's trainer cannot be built under transformers 5
    (TRL 0.24's KTOTrainer reads ``model.warnings_issued``, which transformers 5 removed)."""
    import transformers
    import trl
    from packaging.version import Version

    try:
        yield
    except AttributeError as exc:
        if "warnings_issued" not in str(exc) or Version(trl.__version__) >= Version(NEWEST_TRL):
            raise
        pytest.skip(f"TRL {trl.__version__}'s {trainer_cls.__name__} cannot be built under transformers "
                    f"{transformers.__version__}: {exc}")  # fmt: skip


def dpo(tmp_path, rows, **kwargs):
    DPOConfig, DPOTrainer = from_trl("trl", "DPOConfig", "DPOTrainer")

    return build(DPOTrainer, DPOConfig, tmp_path, rows, **kwargs)


def kto(tmp_path, rows, **kwargs):
    KTOConfig, KTOTrainer = from_trl("trl", "KTOConfig", "KTOTrainer")

    return build(KTOTrainer, KTOConfig, tmp_path, rows, **kwargs)


def reward(tmp_path, rows, **kwargs):
    """A reward model: the tiny model with a one-output sequence-classification head."""
    RewardConfig, RewardTrainer = from_trl("trl", "RewardConfig", "RewardTrainer")

    model = AutoModelForSequenceClassification.from_pretrained(folder(), num_labels=1)
    return build(RewardTrainer, RewardConfig, tmp_path, rows, model=model, **kwargs)


def cpo(tmp_path, rows, **kwargs):
    CPOConfig, CPOTrainer = from_trl("trl.experimental.cpo", "CPOConfig", "CPOTrainer")

    return build(CPOTrainer, CPOConfig, tmp_path, rows, **kwargs)


def orpo(tmp_path, rows, **kwargs):
    ORPOConfig, ORPOTrainer = from_trl("trl.experimental.orpo", "ORPOConfig", "ORPOTrainer")

    return build(ORPOTrainer, ORPOConfig, tmp_path, rows, **kwargs)


# -- RL: GRPO and RLOO on the tiny model fine-tuned to answer the demo chats and end its turn -------------------
def trained_folder() -> Path:
    from hf_sanity.testing import trained_model_dir

    return trained_model_dir("clean")


def rendered(rows, tok=None) -> list[dict]:
    """Text prompts as a user who renders the chat template before the trainer sees it (TRL's standard format)."""
    tok = tok or AutoTokenizer.from_pretrained(trained_folder())
    return [
        {**row, "prompt": tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)}
        for row in rows
    ]


def text_of(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def length_reward(completions, **kwargs):
    """A graded reward that varies within a group: completions near 30 characters score best."""
    return [-abs(len(text_of(c)) - 30) / 30 for c in completions]


def answer_reward(completions, answer, **kwargs):
    """1 when the completion holds the reference answer's last word (read right for both formats)."""
    return [float(a.split()[-1].rstrip(".") in text_of(c)) for c, a in zip(completions, answer)]


def rl_config(tmp_path, **overrides) -> dict:
    """What every RL setup here shares: 4 prompts' worth of completions per step (batch 4, G=4), short, fp32."""
    return {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 24,
        "temperature": 1.2,  # the trained model is sure of its answers: at 1.0 a group's completions often agree
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "bf16": False,
        "gradient_checkpointing": False,
        "learning_rate": 1e-4,
        "seed": 0,
        **overrides,
    }


def rl(
    trainer_cls, config_cls, tmp_path, rows, reward_funcs, *, callbacks=(), model=None, tok=None, **config
):
    """``trainer_cls`` on the trained tiny model loaded from its folder, with ``rl_config`` settings."""
    model = model if model is not None else AutoModelForCausalLM.from_pretrained(trained_folder())
    return trainer_cls(
        model=model,
        reward_funcs=reward_funcs,
        args=config_cls(**rl_config(tmp_path, **config)),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok or AutoTokenizer.from_pretrained(trained_folder()),
        callbacks=list(callbacks),
    )


def grpo(tmp_path, rows, reward_funcs, **kwargs):
    GRPOConfig, GRPOTrainer = from_trl("trl", "GRPOConfig", "GRPOTrainer")

    return rl(GRPOTrainer, GRPOConfig, tmp_path, rows, reward_funcs, **kwargs)


def rloo(tmp_path, rows, reward_funcs, **config):
    """RLOO with its own defaults where they differ from GRPO's (num_generations=2, beta=0.05) unless given."""
    RLOOConfig, RLOOTrainer = from_trl("trl", "RLOOConfig", "RLOOTrainer")

    config = {"num_generations": 2, "beta": 0.05, **config}
    return rl(RLOOTrainer, RLOOConfig, tmp_path, rows, reward_funcs, **config)
