"""SanityCallback on a user's own `nn.Module` under a plain Trainer: a forward with its own signature
(`forward(x, labels=None)`: float features, no `use_cache`, no `input_ids`), returning a plain dict. The callback
calls the model only with what its forward accepts: a clean run is silent with no internal-error, and a NaN in
the input features is found at its step with the cause `input`."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import Trainer, TrainingArguments, default_data_collator

from hf_sanity.callback import SanityCallback

DIM, VOCAB, LENGTH = 8, 16, 6


class FeatureLM(torch.nn.Module):
    """Predicts a token per position from float features (what a speech or time-series head looks like)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(DIM, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x, labels=None):
        logits = self.head(torch.tanh(self.proj(x)))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100
            )
        return {"loss": loss, "logits": logits}


def rows(n: int = 64, seed: int = 0) -> datasets.Dataset:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, LENGTH, DIM, generator=generator, device="cpu")
    labels = (x[..., 0] > 0).long() + 2 * (x[..., 1] > 0).long()  # learnable from the features
    return datasets.Dataset.from_dict({"x": x.tolist(), "labels": labels.tolist()})


def nan_at(batch_number: int):
    calls = [0]

    def collate(features):
        batch = default_data_collator(features)
        calls[0] += 1
        if calls[0] == batch_number:
            batch["x"][0, 1, 2] = float("nan")
        return batch

    return collate


def train(tmp_path, *, collator=default_data_collator, seed=0, steps=24):
    torch.manual_seed(seed)
    callback = SanityCallback(use_config=False, print_findings=False, check_every=4, probe_every=4)
    trainer = Trainer(
        model=FeatureLM(),
        args=TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=steps,
            per_device_train_batch_size=8,
            learning_rate=1e-2,
            logging_steps=4,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=seed,
            disable_tqdm=True,
        ),
        train_dataset=rows(seed=seed),
        data_collator=collator,
        callbacks=[callback],
    )
    trainer.train()
    return trainer, callback


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.clean("training", "internal-error")
def test_a_custom_module_trains_silently(tmp_path, seed):
    trainer, callback = train(tmp_path, seed=seed)
    assert [f"{f.rule}: {f.message}" for f in callback.report.findings if f.severity != "info"] == []
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]  # it learned: silence is not blindness


def test_a_nan_in_the_features_of_a_custom_module_is_an_input_cause(tmp_path):
    _, callback = train(tmp_path, collator=nan_at(3), steps=8)
    assert not callback.report.by_rule("internal-error")
    finding = callback.report.by_rule("nonfinite-loss")[0]
    assert (finding.step, finding.evidence["cause"]) == (3, "input")
    assert finding.evidence["input_nonfinite"] == ["x"]
