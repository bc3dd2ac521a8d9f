"""`shape-mismatch` with cause `broadcast`: what the loss is computed from, watched at the first real step of a
real Trainer run (the trainer's own compute_loss, a custom model's forward). A (B, 1) regression output against
(B,) targets computes a (B, B) loss that trains without an error: named at step 1, with where it happens and
torch's own warning where torch raised one; every clean loss is silent and the run is the run unwatched."""

from __future__ import annotations

import warnings

import datasets
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainingArguments

from hf_sanity.callback import SanityCallback

FEATURES = 8


class Regressor(nn.Module):
    """A small regression net with a (B, 1) head, as one writes it."""

    def __init__(self, seed: int = 0, *, loss_inside: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1))
        self.loss_inside = loss_inside

    def forward(self, x, labels=None):
        out = self.net(x)
        if labels is None or self.loss_inside is None:
            return out
        target = labels if self.loss_inside == "broadcast" else labels.view_as(out)
        return {"loss": ((out - target) ** 2).mean(), "logits": out}


LOSSES = {
    "broadcast": lambda out, y: ((out - y) ** 2).mean(),  # (B, 1) - (B,) -> (B, B)
    "mse-broadcast": lambda out, y: F.mse_loss(out, y),  # the same, torch warns
    "squeezed": lambda out, y: ((out.squeeze(-1) - y) ** 2).mean(),
    "mse": lambda out, y: F.mse_loss(out.squeeze(-1), y),
    "view-as": lambda out, y: F.smooth_l1_loss(out, y.view_as(out)),
    # a ranking loss that broadcasts on purpose, within the output and within the labels
    "pairwise": lambda out, y: F.softplus(
        -(out.squeeze(-1)[:, None] - out.squeeze(-1)[None, :]) * torch.sign(y[:, None] - y[None, :])
    ).mean(),
}


class RegressionTrainer(Trainer):
    loss_name = "squeezed"

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        out = model(**inputs)
        loss = LOSSES[self.loss_name](out, labels)
        return (loss, out) if return_outputs else loss


def rows(n: int = 64, seed: int = 0) -> datasets.Dataset:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator, device="cpu")
    y = x @ torch.randn(FEATURES, generator=generator, device="cpu")
    return datasets.Dataset.from_dict({"x": x.tolist(), "labels": y.tolist()})


def train(tmp_path, loss: str | None, *, seed=0, batch=8, steps=40, watch=True, loss_inside=None):
    callback = SanityCallback(use_config=False, print_findings=False) if watch else None
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=batch,
                             learning_rate=1e-2, logging_steps=5, report_to=[], use_cpu=True, save_strategy="no",
                             label_names=["labels"], seed=seed, disable_tqdm=True)  # fmt: skip
    cls = Trainer if loss is None else type("T", (RegressionTrainer,), {"loss_name": loss})
    trainer = cls(model=Regressor(seed, loss_inside=loss_inside), args=args, train_dataset=rows(seed=seed),
                  callbacks=[callback] if callback else [])  # fmt: skip
    trainer.train()
    return trainer, callback


def shape_findings(callback):
    return [f for f in callback.report.findings if f.rule in ("shape-mismatch", "internal-error")]


@pytest.mark.planted("shape-mismatch")
def test_a_regression_loss_that_broadcasts_is_named_at_step_1(tmp_path):
    _, callback = train(tmp_path, "broadcast")
    [found] = shape_findings(callback)
    assert found.rule == "shape-mismatch" and found.step == 1
    assert found.evidence["cause"] == "broadcast"
    [op] = found.evidence["operations"]
    assert (op["output"], op["labels"], op["result"]) == ([8, 1], [8], [8, 8])
    assert op["at"].startswith(__file__) and "squeeze(-1)" in found.fix
    assert "(8, 1)" in found.message and "(8, 8)" in found.message
    assert callback.report.stats["loss_watch"]["broadcasts"] == 1


@pytest.mark.planted("shape-mismatch")
def test_torch_s_broadcast_warning_is_surfaced_and_still_shown(tmp_path):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        _, callback = train(tmp_path, "mse-broadcast", steps=3)
    [found] = shape_findings(callback)
    assert found.evidence["cause"] == "broadcast" and found.step == 1
    assert found.evidence["operations"][0]["op"] == "mse_loss"
    assert "broadcasting" in found.evidence["torch_warnings"][0]
    # the user still sees torch's warning of each step, pointing at their own line
    theirs = [w for w in shown if "broadcasting" in str(w.message)]
    assert len(theirs) == 3 and {w.filename for w in theirs} == {__file__}


@pytest.mark.planted("shape-mismatch")
def test_a_custom_forward_whose_own_loss_broadcasts(tmp_path):
    _, callback = train(tmp_path, None, loss_inside="broadcast", steps=3)
    [found] = shape_findings(callback)
    assert found.evidence["cause"] == "broadcast" and found.evidence["operations"][0]["result"] == [8, 8]


@pytest.mark.clean("shape-mismatch")
@pytest.mark.parametrize("loss", ["squeezed", "mse", "view-as", "pairwise"])
@pytest.mark.parametrize("seed,batch", [(0, 8), (1, 4), (2, 16)])
def test_losses_without_broadcasting_are_silent(tmp_path, loss, seed, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no broadcast warning, and none made up
        _, callback = train(tmp_path, loss, seed=seed, batch=batch, steps=6)
    assert shape_findings(callback) == []
    assert callback.report.stats["loss_watch"]["compared"] >= 1  # the loss was looked at


@pytest.mark.clean("shape-mismatch")
def test_a_custom_forward_with_a_matching_loss_is_silent(tmp_path):
    _, callback = train(tmp_path, None, loss_inside="view-as", steps=3)
    assert shape_findings(callback) == [] and callback.report.stats["loss_watch"]["compared"] >= 1


@pytest.mark.clean("shape-mismatch")
@pytest.mark.parametrize("loss", ["broadcast", "squeezed"])
def test_a_watched_run_is_the_run_unwatched(tmp_path, loss):
    """The watch only observes: weights and logged losses are bit-for-bit those of the run without it, the bug
    included."""
    runs = [train(tmp_path / str(w), loss, watch=w, steps=10)[0] for w in (False, True)]
    logged = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in runs]
    assert logged[0] == logged[1]
    weights = [t.model.state_dict() for t in runs]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.clean("shape-mismatch")
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_language_model_runs_are_silent(tmp_path, smoothing):
    """A causal LM's own loss (inside its forward) and Trainer's label smoother."""
    from transformers import DataCollatorForLanguageModeling

    from hf_sanity.testing import demo_conversations, tiny_setup

    model, tok = tiny_setup("chatml")
    data = datasets.Dataset.from_list(
        [{"input_ids": tok.apply_chat_template(r["messages"])["input_ids"]} for r in demo_conversations(16)]
    )
    callback = SanityCallback(use_config=False, print_findings=False, select="shape-mismatch")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", label_smoothing_factor=smoothing, disable_tqdm=True)  # fmt: skip
    Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            callbacks=[callback]).train()  # fmt: skip
    assert shape_findings(callback) == [] and isinstance(callback.report.stats["loss_watch"], dict)
