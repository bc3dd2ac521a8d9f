"""SanityCallback on real (tiny, CPU) Trainer runs: each rule fires on its planted bug at the step where the
bug first shows, with only that rule selected; clean runs stay silent."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from dist import tinytrain as tt
from transformers import DataCollatorForSeq2Seq, Trainer

from hf_sanity.callback import SanityCallback


def watch(select=None, **kwargs) -> SanityCallback:
    kwargs = {"check_every": 5, "probe_every": 5, **kwargs}
    return SanityCallback(select=select, use_config=False, print_findings=False, **kwargs)


def train(tmp_path, select, *, callback_kwargs=None, expect_raise=None, **trainer_kwargs):
    """Train the tiny setup with a SanityCallback that selects ``select``; returns (trainer, callback)."""
    callback = watch(select, **(callback_kwargs or {}))
    trainer = tt.trainer(tmp_path / "out", callbacks=[callback], **trainer_kwargs)
    if expect_raise:
        with pytest.raises(expect_raise):
            trainer.train()
    else:
        trainer.train()
    return trainer, callback


def only(callback, slug):
    """The one finding of ``slug`` (the report holds nothing else)."""
    found = callback.report.findings
    assert [f.rule for f in found] == [slug], [f"{f.rule}@{f.step}: {f.message}" for f in found]
    return found[0]


def written(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "hf-sanity" / "report.json").read_text())


def subclass(compute_loss=None, training_step=None, **attrs):
    """A Trainer subclass with a planted compute_loss/training_step."""
    body = dict(attrs)
    if compute_loss:
        body["compute_loss"] = compute_loss
    if training_step:
        body["training_step"] = training_step
    return type("Planted", (Trainer,), body)


# -- nonfinite-loss: exact first step, cause, module, saved batch ---------------------------------------
@pytest.mark.planted("nonfinite-loss")
def test_nonfinite_loss_from_the_input_names_step_module_and_saves_the_batch(tmp_path):
    model, tok = tt.setup()
    _, cb = train(
        tmp_path, ["nonfinite-loss"], model=model, tok=tok, collator=tt.embeds_collator(tok, model, 3)
    )
    finding = only(cb, "nonfinite-loss")
    assert finding.step == 3
    assert finding.evidence["cause"] == "input"
    assert finding.evidence["input_nonfinite"] == ["inputs_embeds"]
    assert finding.evidence["module"] == "model.layers.0.input_layernorm"  # the first module fed the NaN
    saved = finding.evidence["batch_file"]
    from safetensors.torch import load_file

    assert torch.isnan(load_file(saved)["inputs_embeds"]).sum() == 1


def test_nonfinite_loss_from_log_of_zero_is_unsafe_math(tmp_path):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[:, :-1]
        target, mask = labels[:, 1:], labels[:, 1:] != -100
        temperature = 1e-4 if self.state.global_step >= 2 else 1.0  # from step 3 softmax underflows to 0
        probs = torch.softmax(logits / temperature, -1)
        onehot = torch.nn.functional.one_hot(target.clamp(min=0), probs.shape[-1])
        return -(onehot * torch.log(probs)).sum(-1)[mask].mean()  # 0 * log(0) = NaN

    _, cb = train(tmp_path, ["nonfinite-loss"], cls=subclass(compute_loss))
    finding = only(cb, "nonfinite-loss")
    assert (finding.step, finding.evidence["cause"]) == (3, "unsafe-math")
    assert finding.evidence["logits_finite"] is True and finding.evidence["module"] is None


def test_nonfinite_loss_after_a_blow_up_is_lr_too_high(tmp_path):
    _, cb = train(
        tmp_path, ["nonfinite-loss", "nonfinite-grad"], optim="sgd", learning_rate=10.0, max_grad_norm=0.0
    )
    loss, grad = cb.report.by_rule("nonfinite-loss")[0], cb.report.by_rule("nonfinite-grad")[0]
    assert (loss.step, loss.evidence["cause"]) == (7, "lr-too-high")
    assert grad.step == 6  # the gradient overflowed one step before the loss did
    assert loss.evidence["grad_norms_before"][-1] in ("inf", "nan")  # evidence is JSON: non-finite as text


class Float16Autocast(Trainer):
    """Mixed precision the way a custom loop does it: fp16 autocast around the loss (works on the CPU, where
    accelerate refuses fp16 AMP)."""

    def autocast_smart_context_manager(self, cache_enabled=True):
        return torch.autocast("cpu", dtype=torch.float16)


@pytest.mark.parametrize("precision", ["fp16-weights", "fp16-autocast"])
def test_nonfinite_loss_in_half_precision_is_precision_overflow(tmp_path, precision):
    model, tok = tt.setup()
    with torch.no_grad():  # activations overflow fp16 (> 65504) while every weight fits in it
        model.model.layers[0].mlp.up_proj.weight.mul_(3000)
        model.model.layers[0].mlp.down_proj.weight.mul_(3000)
    if precision == "fp16-weights":
        model.half()  # a model loaded in float16 and trained without AMP
    cls = Float16Autocast if precision == "fp16-autocast" else None
    _, cb = train(tmp_path, ["nonfinite-loss"], model=model, tok=tok, cls=cls, max_steps=2)
    finding = only(cb, "nonfinite-loss")
    assert (finding.step, finding.evidence["cause"]) == (1, "precision-overflow")
    assert finding.evidence["fp32_finite"] is True
    assert finding.evidence["module"] == "model.layers.0.mlp.down_proj"


def test_all_labels_masked_is_empty_loss_mask_then_nan(tmp_path):
    model, tok = tt.setup()
    masked = [{"input_ids": r["input_ids"], "labels": [-100] * len(r["labels"])} for r in tt.rows(tok)]
    _, cb = train(tmp_path, ["empty-loss-mask", "nonfinite-loss"], model=model, tok=tok, data=masked)
    empty, nan = cb.report.by_rule("empty-loss-mask")[0], cb.report.by_rule("nonfinite-loss")[0]
    assert empty.step == 1 and empty.evidence["count"] == 4  # the first batch, checked as the model sees it
    assert (nan.step, nan.evidence["cause"], nan.evidence["supervised_tokens"]) == (1, "empty-loss-mask", 0)


# -- gradients ------------------------------------------------------------------------------------------
@pytest.mark.planted("nonfinite-grad")
def test_nonfinite_grad_with_a_finite_loss(tmp_path):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        if self.state.global_step == 3:  # sqrt(0) forward is 0, its gradient is inf -> NaN
            return out.loss + torch.sqrt((out.logits - out.logits.detach()).pow(2).sum())
        return out.loss

    _, cb = train(tmp_path, ["nonfinite-grad"], cls=subclass(compute_loss))
    assert only(cb, "nonfinite-grad").step == 4


@pytest.mark.planted("grad-explosion")
def test_grad_explosion_names_the_step_and_saves_its_batch(tmp_path):
    """Clipping on (Trainer's default): one batch 1000x too heavy at step 8 is bounded by the clip and the run
    recovers at step 9 (info); a second such batch at step 11 makes them repeated (a warning, its batch saved)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super(type(self), self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 1000 if self.state.global_step in (7, 10) else loss  # two batches 1000x too heavy

    _, cb = train(tmp_path, ["grad-explosion"], cls=subclass(compute_loss))
    first, second = cb.report.findings
    assert (first.rule, first.step, first.severity) == ("grad-explosion", 8, "info")
    assert first.evidence["recovered"] is True and first.evidence["max_grad_norm"] == 1.0
    assert first.evidence["ratio"] > 100
    assert first.evidence["batch_file"].endswith("grad-explosion-step8.safetensors")
    assert (second.rule, second.step, second.severity) == ("grad-explosion", 11, "warning")
    assert second.evidence["explosion_steps"] == [8, 11]
    assert second.evidence["batch_file"].endswith("grad-explosion-step11.safetensors")


@pytest.mark.planted("stale-gradients")
def test_stale_gradients_when_zero_grad_is_disabled(tmp_path):
    model, tok = tt.setup()
    model.zero_grad = lambda *args, **kwargs: None  # gradients are never cleared
    _, cb = train(tmp_path, ["stale-gradients"], model=model, tok=tok)
    finding = only(cb, "stale-gradients")
    assert finding.step == 2  # the first step that begins with the previous step's gradients
    norms = finding.evidence["grad_norms"]
    assert norms[-1] > norms[0]


# -- the gradient path: loss-flat and its causes, the optimizer, the LR -------------------------------
@pytest.mark.planted("loss-flat")
def test_detached_loss_is_loss_flat_no_grad(tmp_path):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super(type(self), self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss.detach().requires_grad_()  # the usual "fix" for "does not require grad"

    _, cb = train(tmp_path, ["loss-flat"], cls=subclass(compute_loss))
    finding = only(cb, "loss-flat")
    assert (finding.step, finding.evidence["cause"]) == (1, "no-grad")


def test_optimizer_over_another_model_is_not_in_optimizer(tmp_path):
    model, tok = tt.setup()
    stale_copy = copy.deepcopy(model)  # the optimizer was built before the model was replaced
    optimizer = torch.optim.AdamW(stale_copy.parameters(), lr=1e-3)
    _, cb = train(
        tmp_path,
        ["loss-flat", "optimizer-missing-params"],
        model=model,
        tok=tok,
        optimizers=(optimizer, None),
    )
    missing, flat = cb.report.by_rule("optimizer-missing-params")[0], cb.report.by_rule("loss-flat")[0]
    assert missing.step == 0 and missing.evidence["missing"] == missing.evidence["trainable"] == 21
    assert (flat.step, flat.evidence["cause"]) == (1, "not-in-optimizer")


@pytest.mark.planted("optimizer-missing-params")
def test_optimizer_over_a_subset_is_optimizer_missing_params(tmp_path):
    model, tok = tt.setup()
    optimizer = torch.optim.AdamW(model.lm_head.parameters(), lr=1e-3)
    _, cb = train(tmp_path, ["optimizer-missing-params"], model=model, tok=tok, optimizers=(optimizer, None))
    finding = only(cb, "optimizer-missing-params")
    assert finding.evidence["missing"] == 20 and "model.embed_tokens.weight" in finding.evidence["names"]


@pytest.mark.planted("lr-zero")
def test_lr_zero_and_loss_flat(tmp_path):
    _, cb = train(tmp_path, ["lr-zero", "loss-flat"], learning_rate=0.0)
    zero, flat = cb.report.by_rule("lr-zero")[0], cb.report.by_rule("loss-flat")[0]
    assert zero.step == 1
    assert (flat.step, flat.evidence["cause"]) == (1, "lr-zero")


def test_warmup_from_zero_is_not_lr_zero(tmp_path):
    _, cb = train(tmp_path, ["lr-zero", "loss-flat"], warmup_steps=3, lr_scheduler_type="linear")
    assert cb.report.findings == []


@pytest.mark.planted("lr-too-low")
def test_lr_too_low(tmp_path):
    _, cb = train(tmp_path, ["lr-too-low"], learning_rate=1e-8)
    finding = only(cb, "lr-too-low")
    assert finding.step == 1 and finding.evidence["update_ratio"] < 1e-6


# -- train mode, loss sign, prior, predictions --------------------------------------------------------
@pytest.mark.planted("train-mode-off")
def test_train_mode_off_after_an_evaluation(tmp_path):
    def evaluate(self, *args, **kwargs):
        self.evaluated = True
        return Trainer.evaluate(self, *args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.evaluated:
            return Trainer.training_step(self, model, inputs, num_items_in_batch)
        model.train = lambda mode=True: model  # model.train() no longer switches back after evaluating
        try:
            return Trainer.training_step(self, model, inputs, num_items_in_batch)
        finally:
            del model.train

    model, tok = tt.setup(dropout=0.1)
    cls = subclass(training_step=training_step, evaluate=evaluate, evaluated=False)
    eval_rows = tt.rows(tok, 8)
    _, cb = train(
        tmp_path, ["train-mode-off"], model=model, tok=tok, cls=cls,
        eval_strategy="steps", eval_steps=4, eval_dataset=eval_rows,
    )  # fmt: skip
    finding = only(cb, "train-mode-off")
    assert finding.step == 5 and finding.evidence["after_evaluation"] == 4
    assert finding.evidence["train_only_modules"] >= 1  # dropout is on


@pytest.mark.planted("negative-loss")
def test_negative_loss(tmp_path):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super(type(self), self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return -loss if self.state.global_step >= 3 else loss  # a sign error from step 4

    _, cb = train(tmp_path, ["negative-loss"], cls=subclass(compute_loss))
    finding = only(cb, "negative-loss")
    assert finding.step == 4 and finding.evidence["loss"] < 0


@pytest.mark.planted("loss-plateau-prior")
def test_loss_plateau_at_the_label_prior_when_inputs_do_not_reach_the_model(tmp_path):
    model, tok = tt.setup()
    base = DataCollatorForSeq2Seq(tok)

    def collate(features):  # the model sees one token at one position: only the label prior is learnable
        batch = base(features)
        batch["input_ids"] = torch.full_like(batch["input_ids"], 5)
        batch["position_ids"] = torch.zeros_like(batch["input_ids"])
        return batch

    _, cb = train(
        tmp_path, ["loss-plateau-prior"], model=model, tok=tok, collator=collate, max_steps=100,
        learning_rate=1e-2, callback_kwargs={"check_every": 10},
    )  # fmt: skip
    finding = only(cb, "loss-plateau-prior")
    assert (
        abs(finding.evidence["loss_level"] - finding.evidence["label_entropy"])
        < 0.05 * finding.evidence["label_entropy"]
    )
    assert finding.evidence["start_loss"] > 1.5 * finding.evidence["label_entropy"]


@pytest.mark.planted("predictions-frozen")
def test_predictions_frozen_while_an_outside_parameter_lowers_the_loss(tmp_path):
    model, tok = tt.setup()
    model.requires_grad_(False)
    bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))  # trained, but not part of the model

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits + bias
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )

    optimizer = torch.optim.AdamW([bias], lr=0.05)
    _, cb = train(
        tmp_path, ["predictions-frozen", "no-trainable-params"], model=model, tok=tok,
        cls=subclass(compute_loss), optimizers=(optimizer, None), max_steps=20,
    )  # fmt: skip
    frozen, none = cb.report.by_rule("predictions-frozen")[0], cb.report.by_rule("no-trainable-params")[0]
    assert frozen.step == 5 and frozen.evidence["probes"] == [5, 10, 15]
    assert cb.report.stats["probes"] >= 3  # the probes the time budget ran (the first 3 always run)
    assert frozen.evidence["loss_change"] < -0.05
    assert none.step == 0


# -- memory ---------------------------------------------------------------------------------------------
def keeping_losses(raise_oom_at=None):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super(type(self), self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append(loss)  # the loss tensor, with its whole graph, kept for "logging"
        if raise_oom_at is not None and self.state.global_step + 1 == raise_oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss

    def init(self, *args, **kwargs):
        Trainer.__init__(self, *args, **kwargs)
        self.losses = []

    return subclass(compute_loss, __init__=init)


@pytest.mark.planted("memory-growth")
def test_memory_growth_names_the_list_that_holds_the_graphs(tmp_path):
    _, cb = train(tmp_path, ["memory-growth"], cls=keeping_losses(), callback_kwargs={"check_every": 1})
    finding = only(cb, "memory-growth")
    assert finding.step == 1 and finding.evidence["per_step"] == 1.0
    assert finding.evidence["holder"] == "trainer.losses"
    assert cb.report.stats["memory_walks"] >= 4  # the walks its time budget ran (the first 4 always run)


@pytest.mark.planted("oom")
def test_oom_after_growth_says_so_and_writes_the_report(tmp_path):
    _, cb = train(
        tmp_path, ["oom", "memory-growth"], cls=keeping_losses(raise_oom_at=7),
        callback_kwargs={"check_every": 2}, expect_raise=torch.OutOfMemoryError,
    )  # fmt: skip
    oom = cb.report.by_rule("oom")[0]
    assert oom.step == 7 and oom.evidence["growth_before"] is True
    assert oom.evidence["parameters_bytes"] > 0 and "optimizer_state_bytes" in oom.evidence
    report = written(tmp_path)
    assert {f["rule"] for f in report["findings"]} == {"oom", "memory-growth"}
    assert report["stats"]["aborted_by"] == "OutOfMemoryError"


# -- the first batch ------------------------------------------------------------------------------------
@pytest.mark.planted("shape-mismatch")
def test_shape_mismatch_is_reported_before_the_crash(tmp_path):
    model, tok = tt.setup()
    base = DataCollatorForSeq2Seq(tok)

    def collate(features):  # labels padded 3 tokens longer than input_ids
        batch = base(features)
        batch["labels"] = torch.cat([batch["labels"], torch.full((batch["labels"].shape[0], 3), -100)], 1)
        return batch

    _, cb = train(
        tmp_path, ["shape-mismatch"], model=model, tok=tok, collator=collate, expect_raise=ValueError
    )
    finding = only(cb, "shape-mismatch")
    assert finding.step == 1
    assert finding.evidence["shapes"]["labels"][1] == finding.evidence["shapes"]["input_ids"][1] + 3
    assert [f["rule"] for f in written(tmp_path)["findings"]] == ["shape-mismatch"]


def test_init_loss_far_above_chance(tmp_path):
    model, tok = tt.setup()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # a broken init: confident, wrong logits
    _, cb = train(tmp_path, ["init-loss-off-chance"], model=model, tok=tok, max_steps=2)
    finding = only(cb, "init-loss-off-chance")
    assert finding.step == 1 and finding.evidence["direction"] == "above"
    assert finding.evidence["loss"] > 2 * finding.evidence["ln_vocab"]
    assert finding.evidence["cause"] == "nothing-predicted" and finding.severity == "error"


def test_shifted_labels_are_seen_on_the_first_batch(tmp_path):
    model, tok = tt.setup()
    shifted = [{"input_ids": r["input_ids"], "labels": r["input_ids"][1:] + [-100]} for r in tt.rows(tok)]
    _, cb = train(tmp_path, ["labels-misaligned"], model=model, tok=tok, data=shifted, max_steps=2)
    finding = only(cb, "labels-misaligned")
    assert finding.step == 1 and finding.evidence["rows"] == [0, 1, 2, 3]


def test_prompt_in_loss_on_the_first_batch(tmp_path):
    model, tok = tt.setup()
    _, cb = train(
        tmp_path, ["prompt-in-loss"], model=model, tok=tok, data=tt.rows(tok, loss_on="all"), max_steps=2
    )
    assert only(cb, "prompt-in-loss").evidence["fraction"] > 0.5


# -- evaluation: the curve rules --------------------------------------------------------------------------
def test_curve_rules_run_at_each_evaluation(tmp_path):
    model, tok = tt.setup()
    _, cb = train(
        tmp_path, ["eval-constant"], model=model, tok=tok, max_steps=10, eval_strategy="steps", eval_steps=2,
        eval_dataset=tt.rows(tok, 8), compute_metrics=lambda prediction: {"accuracy": 0.5},
    )  # fmt: skip
    finding = only(cb, "eval-constant")
    assert finding.evidence["evaluations"] == 3 and finding.evidence["first_step"] == 2


# -- reporting, abort, selection ------------------------------------------------------------------------
def test_abort_on_error_stops_at_the_first_error_after_writing_the_report(tmp_path):
    model, tok = tt.setup()
    trainer, _ = train(
        tmp_path, None, model=model, tok=tok, collator=tt.embeds_collator(tok, model, 3),
        callback_kwargs={"abort_on": "error"}, max_steps=12,
    )  # fmt: skip
    assert trainer.state.global_step == 3  # stopped cleanly right after the NaN step
    report = written(tmp_path)
    assert report["findings"][0]["rule"] == "nonfinite-loss" and report["findings"][0]["step"] == 3


def test_findings_reach_the_logs_of_every_reporter(tmp_path):
    from transformers import TrainerCallback

    seen = []

    class Reporter(TrainerCallback):  # stands for wandb/tensorboard: registered before the sanity callback
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    cb = watch(["negative-loss"])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return -super(type(self), self).compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = tt.trainer(
        tmp_path / "out", callbacks=[Reporter(), cb], cls=subclass(compute_loss), logging_steps=2
    )
    trainer.train()
    assert seen[0]["loss"] < 0 and seen[0]["hf_sanity/negative-loss"] == 1  # the first log already carries it


def test_ignore_silences_a_rule_and_the_report_is_written_at_the_end(tmp_path):
    _, cb = train(tmp_path, None, learning_rate=0.0, callback_kwargs={"ignore": ["loss-flat"]}, max_steps=6)
    assert [f.rule for f in cb.report.findings] == ["lr-zero"]
    report = written(tmp_path)
    assert [f["rule"] for f in report["findings"]] == ["lr-zero"]
    assert report["stats"]["steps"] == 6 and report["stats"]["transfers"] >= 1


def test_bad_arguments_fail_fast():
    with pytest.raises(ValueError, match="abort_on"):
        SanityCallback(abort_on="warning")
    with pytest.raises(ValueError, match="check_every"):
        SanityCallback(check_every=0)
