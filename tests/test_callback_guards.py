"""Never the run's, through real Trainer runs on hostile models: a model whose embeddings transformers cannot
resolve, a forward that refuses hf-sanity's own no-grad forwards, an optional measurement that breaks, a setup
part that breaks, and the user's own exception. Each time the run trains to its end (or dies of the user's
exception, unchanged), its weights are those of the run without the callback, the broken part is reported once,
and the other checks still ran. And the measurement plan: a value is measured because an enabled check reads it
(``select=["loss-diverged"]`` alone still names ``lr-too-high``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from dist import tinytrain as tt
from transformers import PretrainedConfig, PreTrainedModel, Trainer
from transformers.modeling_outputs import CausalLMOutput

from hf_sanity.callback import SanityCallback

GRADIENTS = "hf_sanity.rules.training.gradients.GradientMonitor"
LOSSES = "hf_sanity.rules.training.loss.LossMonitor"


def watch(select=None, **kwargs) -> SanityCallback:
    kwargs = {"check_every": 2, "probe_every": 2, **kwargs}
    return SanityCallback(select=select, use_config=False, print_findings=False, **kwargs)


def weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def twin_runs(tmp_path, make_model, callback, **overrides):
    """The same run without and with ``callback`` (a fresh model from ``make_model()`` each): (trainer without,
    trainer with)."""
    _, tok = tt.setup()
    runs = []
    for name, callbacks in (("without", []), ("with", [callback])):
        trainer = tt.trainer(tmp_path / name, callbacks=callbacks, model=make_model(), tok=tok, **overrides)
        trainer.train()
        runs.append(trainer)
    return runs


def internal_checks(callback) -> list[str]:
    return sorted(f.evidence["check"] for f in callback.report.by_rule("internal-error"))


# -- a model whose embeddings transformers cannot resolve -------------------------------------------------
class OpaqueConfig(PretrainedConfig):
    model_type = "hf-sanity-opaque"

    def __init__(self, vocab_size: int = 64, hidden_size: int = 16, **kwargs) -> None:
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        super().__init__(**kwargs)


class OpaqueLM(PreTrainedModel):
    """A causal LM whose embedding table has a name transformers does not know: ``get_input_embeddings`` raises
    NotImplementedError (transformers' own answer), as for many hand-written PreTrainedModels."""

    config_class = OpaqueConfig

    def __init__(self, config: OpaqueConfig) -> None:
        super().__init__(config)
        self.table = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        logits = self.head(torch.tanh(self.mix(self.table(input_ids))))
        loss = None
        if labels is not None:
            flat = logits[:, :-1].reshape(-1, logits.size(-1))
            loss = torch.nn.functional.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


def test_a_model_whose_embeddings_cannot_be_resolved_trains_to_the_end_watched(tmp_path):
    """It used to raise NotImplementedError out of ``trainer.train()`` at train end (the curves' ln V) after a
    train begin that had set nothing up: now V is the config's, and only what needs the embeddings is skipped."""
    _, tok = tt.setup()
    torch.manual_seed(0)
    OpaqueLM(OpaqueConfig(vocab_size=len(tok))).save_pretrained(tmp_path / "opaque")
    loaded = OpaqueLM.from_pretrained(tmp_path / "opaque")
    with pytest.raises(NotImplementedError):
        loaded.get_input_embeddings()  # the hostile part is real
    cb = watch()
    without, with_cb = twin_runs(
        tmp_path, lambda: OpaqueLM.from_pretrained(tmp_path / "opaque"), cb, max_steps=6, logging_steps=2
    )
    assert with_cb.state.global_step == 6
    assert same_weights(weights(without), weights(with_cb))
    skipped = cb.report.by_rule("checks-skipped")  # said, not claimed as measured
    assert skipped and any("vocab-size-mismatch" in f.evidence["skipped"] for f in skipped)
    assert cb.report.by_rule("internal-error") == []
    assert cb.monitors.setup.vocab_size == len(tok)  # chance level from the config: ln V still known
    assert {GRADIENTS, LOSSES} <= cb.monitors.ran  # the step checks watched every step
    assert "hf_sanity.rules.curves.underfitting" in cb.monitors.ran  # and the curves ran at train end
    assert cb.report.stats["steps"] == 6  # the report was written whole
    assert (tmp_path / "with" / "hf-sanity" / "report.json").is_file()


# -- a forward that refuses hf-sanity's own no-grad forwards ----------------------------------------------
def grad_only_model():
    """The tiny Llama, whose forward raises whenever grad is off: only hf-sanity's own extra forwards (the probes,
    the first batch's step-0 numbers and causality check) run without grad in this run (no evaluation)."""
    model, _ = tt.setup()
    forward = model.forward

    @functools.wraps(forward)  # Trainer reads the signature: the dataset's columns are kept
    def refusing(*args, **kwargs):
        if not torch.is_grad_enabled():
            raise RuntimeError("planted: this forward refuses to run without grad")
        return forward(*args, **kwargs)

    model.forward = refusing
    return model


@pytest.mark.internal_error_expected
def test_a_forward_that_raises_in_the_probes_only_skips_the_probes(tmp_path):
    cb = watch()
    without, with_cb = twin_runs(tmp_path, grad_only_model, cb, max_steps=8, logging_steps=2)
    assert with_cb.state.global_step == 8
    assert same_weights(weights(without), weights(with_cb))
    internal = cb.report.by_rule("internal-error")
    assert internal and all("refuses to run without grad" in f.message for f in internal)
    checks = internal_checks(cb)
    assert len(checks) == len(set(checks))  # each broken check said once, though the probe runs every 2 steps
    assert "callback-probe" in checks  # the first batch's probe: named
    assert {GRADIENTS, LOSSES} <= cb.monitors.ran  # the checks that need no extra forward still ran
    assert cb.report.stats["transfers"] >= 4


# -- an optional measurement that breaks --------------------------------------------------------------------
class HeavyBatch(Trainer):
    """Step 7's batch weighs 1000x: a gradient explosion at step 7 (grad-explosion's planted bug)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 1000 if self.state.global_step == 6 else loss


def broken(*args, **kwargs):
    raise RuntimeError("planted: a measurement that breaks")


@pytest.mark.internal_error_expected
def test_an_update_ratio_that_breaks_skips_only_itself(tmp_path, monkeypatch):
    from hf_sanity.training.measures import StepSampler

    monkeypatch.setattr(StepSampler, "after_optimizer", broken)
    cb = watch(check_every=5)
    without, with_cb = twin_runs(tmp_path, lambda: tt.setup()[0], cb, cls=HeavyBatch, max_steps=10)
    assert with_cb.state.global_step == 10
    assert same_weights(weights(without), weights(with_cb))
    assert internal_checks(cb) == ["callback-update-ratio"]  # once, though it broke at every step
    (explosion,) = cb.report.by_rule("grad-explosion")  # the gradient check it does not need still fired
    assert explosion.step == 7 and explosion.evidence["ratio"] > 100


@pytest.mark.internal_error_expected
def test_a_sampler_that_cannot_be_set_up_leaves_the_loss_and_gradient_checks_watching(tmp_path, monkeypatch):
    """One guard once spanned all of train begin: a broken part left the run watched blind."""
    from hf_sanity.training.measures import StepSampler

    monkeypatch.setattr(StepSampler, "__init__", broken)
    cb = watch(check_every=5)
    without, with_cb = twin_runs(tmp_path, lambda: tt.setup()[0], cb, cls=HeavyBatch, max_steps=10)
    assert same_weights(weights(without), weights(with_cb))
    assert internal_checks(cb) == ["callback-sampler"]
    (explosion,) = cb.report.by_rule("grad-explosion")
    assert explosion.step == 7
    assert (
        cb.report.stats["steps"] == 10 and cb.report.stats["transfers"] >= 2
    )  # the report was written whole


# -- the user's exception -----------------------------------------------------------------------------------
def dying_model(raised: list[BaseException]):
    """The tiny Llama whose training forward raises the user's own CUDA out-of-memory error at step 3."""
    model, _ = tt.setup()
    forward, calls = model.forward, [0]

    @functools.wraps(forward)
    def dying(*args, **kwargs):
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == 3:
                raised.append(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
                raise raised[0]
        return forward(*args, **kwargs)

    model.forward = dying
    return model


@pytest.mark.internal_error_expected
def test_the_users_exception_propagates_unchanged_even_when_the_report_breaks(tmp_path, monkeypatch):
    from hf_sanity.training import outcome

    monkeypatch.setattr(outcome, "stats", broken)  # the report's figures break on the way out
    raised: list[BaseException] = []
    cb = watch()
    _, tok = tt.setup()
    trainer = tt.trainer(tmp_path / "out", callbacks=[cb], model=dying_model(raised), tok=tok, max_steps=6)
    with pytest.raises(RuntimeError) as caught:
        trainer.train()
    assert caught.value is raised[0]  # the very object, so its type and message too
    assert type(caught.value) is RuntimeError and str(caught.value).startswith("CUDA out of memory")
    assert "report" in internal_checks(cb)  # what broke is said, in the report
    assert cb.report.stats["aborted_by"] == "RuntimeError"
    assert (tmp_path / "out" / "hf-sanity" / "report.json").is_file()  # and the report was still written
    assert "training_step" not in vars(trainer) and not trainer.model._forward_pre_hooks  # taken back


# -- the catalog: a detector's applies runs inside its guard ----------------------------------------------
@pytest.mark.internal_error_expected
def test_an_applies_that_raises_is_an_internal_error_and_the_other_rules_run(chatml, monkeypatch):
    from helpers import run
    from hf_sanity import catalog
    from hf_sanity.constants import IGNORE_INDEX

    rule = catalog.load()["prompt-in-loss"]
    monkeypatch.setattr(rule, "detectors", [dataclasses.replace(d, applies=broken) for d in rule.detectors])
    rows = tt.rows(chatml, 10)
    rows[3] = {**rows[3], "labels": [IGNORE_INDEX] * len(rows[3]["labels"])}
    report = run(chatml, rows, select=["prompt-in-loss", "empty-loss-mask"])
    internal = report.by_rule("internal-error")
    assert [f.evidence["check"] for f in internal] == ["prompt-in-loss"]
    assert report.by_rule("empty-loss-mask")[0].evidence["rows"] == [3]


# -- the measurement plan: what any enabled check reads --------------------------------------------------
@pytest.mark.planted("loss-diverged")
def test_loss_diverged_alone_still_names_lr_too_high(tmp_path):
    """The update ratio was sampled only for loss-flat and lr-too-low: alone, loss-diverged said ``unknown``."""
    cb = watch(["loss-diverged"], check_every=5, probe_every=5)
    tt.trainer(tmp_path / "out", callbacks=[cb], learning_rate=50.0, max_steps=12).train()
    (diverged,) = cb.report.findings
    assert diverged.rule == "loss-diverged" and diverged.evidence["cause"] == "lr-too-high"
    assert (
        diverged.evidence["update_ratio"] > 1.0
    )  # measured: each update moves the weights more than they are


@pytest.mark.planted("grad-explosion")
def test_grad_explosion_alone_still_names_lr_too_high(tmp_path):
    cb = watch(["grad-explosion"], check_every=5, probe_every=5)
    tt.trainer(tmp_path / "out", callbacks=[cb], learning_rate=50.0, max_steps=12).train()
    (explosion,) = cb.report.findings
    assert explosion.rule == "grad-explosion" and explosion.evidence["cause"] == "lr-too-high"
    assert "update" in explosion.evidence["why"]  # named from the measured update ratio, not guessed
