"""SanityCallback and preflight(trainer=) on a user's own `nn.Module` under a plain Trainer: a forward with its
own signature (`forward(x, labels=None)`: float features, no `use_cache`, no `input_ids`), returning a plain
dict, one that computes its loss whatever it is given, and a hand-written language model without
`get_input_embeddings`. The model is called only with what its forward accepts (with its labels when it needs
them): a clean run is silent with no internal-error, a NaN in the input features is found at its step with the
cause `input`, and a check that cannot measure the model says so once while the others run."""

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


def train(tmp_path, *, collator=default_data_collator, seed=0, steps=24, model_cls=None):
    torch.manual_seed(seed)
    callback = SanityCallback(use_config=False, print_findings=False, check_every=4, probe_every=4)
    trainer = Trainer(
        model=(model_cls or FeatureLM)(),
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


# -- a forward that computes its loss whatever it is given ------------------------------------------------
class LossAlwaysLM(FeatureLM):
    """`forward(x, labels=None)` that reads its labels unconditionally: called without them, it raises."""

    def forward(self, x, labels=None):
        logits = self.head(torch.tanh(self.proj(x)))
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100
        )
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.clean("training", "internal-error")
def test_a_forward_that_always_computes_its_loss_trains_silently(tmp_path, seed):
    trainer, callback = train(tmp_path, seed=seed, model_cls=LossAlwaysLM)
    assert [f"{f.rule}: {f.message}" for f in callback.report.findings if f.severity != "info"] == []
    probes = [h for h in trainer.state.log_history if "loss" in h]
    assert probes[-1]["loss"] < probes[0]["loss"]


@pytest.mark.planted("nonfinite-loss")
def test_a_nan_in_the_features_of_a_forward_that_always_computes_its_loss_is_an_input_cause(tmp_path):
    _, callback = train(tmp_path, collator=nan_at(3), steps=8, model_cls=LossAlwaysLM)
    assert not callback.report.by_rule("internal-error")
    finding = callback.report.by_rule("nonfinite-loss")[0]
    assert (finding.step, finding.evidence["cause"]) == (3, "input"), finding.message
    assert finding.evidence["input_nonfinite"] == ["x"] and finding.evidence["replayed"]


# -- preflight(trainer=) on a hand-written language model --------------------------------------------------
class HandLM(torch.nn.Module):
    """A language model written by hand: an embedding, a GRU and a head, no `get_input_embeddings`.
    ``reads_input=False`` plants a forward that never looks at its tokens."""

    def __init__(self, vocab: int, reads_input: bool = True) -> None:
        super().__init__()
        self.reads_input = reads_input
        self.emb = torch.nn.Embedding(vocab, 32)
        self.rnn = torch.nn.GRU(32, 32, batch_first=True)
        self.out = torch.nn.Linear(32, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        tokens = input_ids if self.reads_input else torch.zeros_like(input_ids)
        hidden, _ = self.rnn(self.emb(tokens))
        logits = self.out(hidden)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return {"loss": loss, "logits": logits}


class PerMicroBatchMean(Trainer):
    """A compute_loss that averages each micro-batch on its own (ignores num_items_in_batch)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs=return_outputs)


def hand_trainer(tmp_path, model=None, cls=Trainer, callbacks=(), **args):
    from dist import tinytrain as tt
    from transformers import DataCollatorForSeq2Seq

    from hf_sanity.testing import build_tokenizer

    tok = build_tokenizer("chatml")
    torch.manual_seed(0)
    return cls(
        model=model or HandLM(len(tok)),
        args=TrainingArguments(
            output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=4,
            save_strategy="no", disable_tqdm=True, max_steps=4, logging_steps=2, **args,
        ),
        train_dataset=datasets.Dataset.from_list(tt.rows(tok)),
        data_collator=DataCollatorForSeq2Seq(tok),
        processing_class=tok,
        callbacks=list(callbacks),
    )  # fmt: skip


MODEL_AND_TRAINER = ["model", "trainer"]


@pytest.mark.clean("model", "trainer", "checks-skipped")
def test_preflight_on_a_hand_written_model_says_once_what_it_cannot_measure(tmp_path):
    from hf_sanity import preflight

    report = preflight(trainer=hand_trainer(tmp_path), select=MODEL_AND_TRAINER, use_config=False)
    (unmeasured,) = report.findings  # no internal-error, and no check skipped for want of the embeddings
    assert unmeasured.rule == "checks-skipped" and unmeasured.severity == "info"
    assert unmeasured.evidence["skipped"] == ["vocab-size-mismatch", "untrained-special-tokens"]
    assert "get_input_embeddings" in unmeasured.evidence["why"] and "needs" not in unmeasured.evidence
    assert report.stats["step0_loss"]["tokens"] > 0  # the step-0 check, which needs vocab-size-mismatch, ran


@pytest.mark.planted("input-ignored")
def test_preflight_on_a_hand_written_model_still_runs_the_checks_that_need_the_embeddings(tmp_path):
    from hf_sanity import preflight
    from hf_sanity.testing import build_tokenizer

    deaf = HandLM(len(build_tokenizer("chatml")), reads_input=False)
    report = preflight(
        trainer=hand_trainer(tmp_path / "deaf", deaf), select=MODEL_AND_TRAINER, use_config=False
    )
    assert {f.rule for f in report.findings} == {"checks-skipped", "input-ignored"}
    scaled = hand_trainer(tmp_path / "mean", cls=PerMicroBatchMean, gradient_accumulation_steps=2)
    report = preflight(trainer=scaled, select=MODEL_AND_TRAINER, use_config=False)
    assert {f.rule for f in report.findings} == {"checks-skipped", "grad-accum-loss-scaling"}


@pytest.mark.clean("tokens", "init-loss-off-chance", "internal-error")
def test_a_hand_written_model_trains_under_the_callback_without_internal_errors(tmp_path):
    callback = SanityCallback(
        use_config=False, print_findings=False, select=["tokens", "init-loss-off-chance"]
    )
    trainer = hand_trainer(tmp_path, callbacks=[callback])
    trainer.train()
    assert callback.report.findings == [] and trainer.state.global_step == 4


@pytest.mark.planted("init-loss-off-chance")
def test_the_callback_judges_the_step_0_loss_of_a_hand_written_model(tmp_path):
    from hf_sanity.testing import build_tokenizer

    broken = HandLM(len(build_tokenizer("chatml")))
    with torch.no_grad():
        broken.out.weight.mul_(60.0)  # confident and wrong from the start
    callback = SanityCallback(use_config=False, print_findings=False, select="init-loss-off-chance")
    hand_trainer(tmp_path, broken, callbacks=[callback]).train()
    (finding,) = callback.report.findings
    assert finding.step == 1 and finding.evidence["cause"] == "nothing-predicted", finding.message


class UnsafeLossLM(FeatureLM):
    """`forward(x, labels=None)` whose own loss takes log(softmax(logits / 1e-4)): infinite from finite logits."""

    def forward(self, x, labels=None):
        logits = self.head(torch.tanh(self.proj(x)))
        probs = torch.softmax(logits / 1e-4, dim=-1)
        loss = -torch.log(probs).gather(-1, labels.clamp(min=0)[..., None]).mean()
        return {"loss": loss, "logits": logits}


@pytest.mark.planted("nonfinite-loss")
def test_an_unsafe_loss_inside_a_forward_that_needs_its_labels_is_unsafe_math(tmp_path):
    """The replay passes the labels this forward needs, and judges the model's output by its logits: they are
    finite, the loss the forward computed from them is not."""
    _, callback = train(tmp_path, steps=4, model_cls=UnsafeLossLM)
    finding = callback.report.by_rule("nonfinite-loss")[0]
    assert (finding.step, finding.evidence["cause"]) == (1, "unsafe-math"), finding.message
    assert finding.evidence["logits_finite"] is True and finding.evidence["module"] is None
