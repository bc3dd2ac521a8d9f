"""TRL's preference and RL trainers on the tiny model, as a user builds them: the model saved to a folder and
loaded from it (TRL reloads the reference from the model's path), a few steps on the CPU."""

from __future__ import annotations

import warnings
from pathlib import Path

import datasets
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hf_sanity.testing import tiny_model_dir

warnings.filterwarnings("ignore", message=".*padding-free.*")


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
    return trainer_cls(
        model=model,
        args=config_cls(**common(tmp_path, **config)),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer(template),
        callbacks=list(callbacks),
        **extra,
    )


def dpo(tmp_path, rows, **kwargs):
    from trl import DPOConfig, DPOTrainer

    return build(DPOTrainer, DPOConfig, tmp_path, rows, **kwargs)


def kto(tmp_path, rows, **kwargs):
    from trl import KTOConfig, KTOTrainer

    return build(KTOTrainer, KTOConfig, tmp_path, rows, **kwargs)


def reward(tmp_path, rows, **kwargs):
    """A reward model: the tiny model with a one-output sequence-classification head."""
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(folder(), num_labels=1)
    return build(RewardTrainer, RewardConfig, tmp_path, rows, model=model, **kwargs)


def cpo(tmp_path, rows, **kwargs):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    return build(CPOTrainer, CPOConfig, tmp_path, rows, **kwargs)


def orpo(tmp_path, rows, **kwargs):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return build(ORPOTrainer, ORPOConfig, tmp_path, rows, **kwargs)
