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


def dpo(tmp_path, rows, *, callbacks=(), model=None, template="chatml", **config):
    from trl import DPOConfig, DPOTrainer

    model = model if model is not None else AutoModelForCausalLM.from_pretrained(folder(template))
    return DPOTrainer(
        model=model,
        args=DPOConfig(**common(tmp_path, **config)),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer(template),
        callbacks=list(callbacks),
    )


def kto(tmp_path, rows, *, callbacks=(), **config):
    from trl import KTOConfig, KTOTrainer

    return KTOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder()),
        args=KTOConfig(**common(tmp_path, **config)),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer(),
        callbacks=list(callbacks),
    )


def reward(tmp_path, rows, *, callbacks=(), peft_config=None, **config):
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(folder(), num_labels=1)
    return RewardTrainer(
        model=model,
        args=RewardConfig(**common(tmp_path, **config)),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer(),
        peft_config=peft_config,
        callbacks=list(callbacks),
    )


def cpo(tmp_path, rows, *, callbacks=(), **config):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    return CPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder()),
        args=CPOConfig(**common(tmp_path, **config)),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer(),
        callbacks=list(callbacks),
    )


def orpo(tmp_path, rows, *, callbacks=(), **config):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return ORPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder()),
        args=ORPOConfig(**common(tmp_path, **config)),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer(),
        callbacks=list(callbacks),
    )
