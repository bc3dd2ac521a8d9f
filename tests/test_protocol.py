"""The debugging protocol (`overfit`, `diagnose`) on real tiny setups: each planted bug is caught with the
right cause, a clean setup passes all five layers, and nothing of the user's is changed."""

from __future__ import annotations

import copy
import io
import math
import random
import time

import datasets
import numpy as np
import pytest
import torch
from rich.console import Console
from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

from hf_sanity.demo import broken_setup, demo_diagnose
from hf_sanity.errors import UserInputError
from hf_sanity.measure.encode import EncodeOptions, Encoder
from hf_sanity.protocol import diagnose, overfit
from hf_sanity.protocol.build import from_objects
from hf_sanity.protocol.steps import half_support, run_precision
from hf_sanity.testing import demo_conversations, tiny_setup

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model is overhead-bound: one intra-op thread is faster, and steadier on shared CPU cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return tiny_setup("chatml", "distinct")


@pytest.fixture
def model(tiny):
    return copy.deepcopy(tiny[0])


@pytest.fixture
def tok(tiny):
    return tiny[1]


def token_rows(tok, n: int = 16) -> datasets.Dataset:
    """Labels on the assistant turns, as TRL's assistant_only_loss computes them."""
    encoder = Encoder(tok, EncodeOptions(fmt="messages", loss_on="assistant"))
    rows = [encoder.encode(r) for r in demo_conversations(n)]
    return datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])


def make_trainer(model, tok, tmp_path, *, cls=Trainer, optimizer=None, collator=None, train=None, **args):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        learning_rate=1e-2,
    )
    return cls(
        model=model,
        args=TrainingArguments(**{**base, **args}),
        train_dataset=train if train is not None else token_rows(tok),
        data_collator=collator or DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100),
        optimizers=(optimizer, None),
    )


def cause(report) -> str:
    [finding] = report.by_rule("overfit-failed")
    assert finding.severity == "error"
    return finding.evidence["cause"]


# -- a clean setup ---------------------------------------------------------------------------------
@pytest.mark.planted("lr-range")
@pytest.mark.clean(
    "protocol", "init-loss-off-chance", "vocab-size-mismatch", "lr-range", "precision-mismatch"
)
def test_clean_setup_overfits_and_passes_all_five_layers(model, tok):
    started = time.perf_counter()
    report = diagnose(model=model, tokenizer=tok, dataset=demo_conversations(16), lr=1e-2, write_repro=False)
    assert not report.has_errors, report.summary()
    assert report.rules() == {"lr-range"} and report.by_rule("lr-range")[0].severity == "info"
    stats = report.stats
    assert stats["broken_layer"] is None
    overfit_stats = stats["overfit"]
    assert overfit_stats["passed"] and overfit_stats["reached_at_step"] is not None
    assert overfit_stats["loss_final"] <= overfit_stats["near_zero"] < overfit_stats["loss_start"]
    assert overfit_stats["steps_run"] < 300
    # every layer ran and every item was ticked from a measurement
    assert {item["layer"] for item in stats["checklist"]} == {1, 2, 3, 4, 5}
    assert [i for i in stats["checklist"] if i["status"] != "passed"] == []
    # the step-0 loss of a fresh head is at chance
    assert abs(stats["init_loss"]["loss"] - stats["init_loss"]["ln_vocab"]) < 0.5
    # the shape table folds the repeated decoder layers and ends with the logits
    shapes = {row["module"]: row for row in stats["shapes"]}
    assert shapes["model.layers.*.mlp.down_proj"]["calls"] == 2
    assert shapes["lm_head"]["output"] == f"(8, {stats['masks']['shapes']['input_ids'][1]}, 1000)"
    # the LR range test gives a finite suggestion an order of magnitude below divergence
    lr = stats["lr_range"]
    assert lr["diverges_at"] is not None and math.isfinite(lr["suggested_lr"])
    assert lr["suggested_lr"] == pytest.approx(lr["diverges_at"] / 10)
    assert 1e-5 < lr["suggested_lr"] < 1
    assert all(row["status"] == "passed" for row in stats["precision"]["half"].values())
    assert all(png.startswith(PNG) for png in report.plots.values()) and len(report.plots) == 2
    assert time.perf_counter() - started < 30


@pytest.mark.slow  # the whole protocol on a Trainer (the fast lane runs it on a model, above)
def test_clean_trainer_diagnose_leaves_trainer_model_and_rng_untouched(model, tok, tmp_path):
    for module in model.modules():  # regularisation the protocol switches off, on its copies only
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    model.config.attention_dropout = 0.1
    trainer = make_trainer(model, tok, tmp_path, weight_decay=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    modes = [m.training for m in model.modules()]

    report = diagnose(trainer=trainer)

    assert not report.has_errors and report.stats["broken_layer"] is None, report.summary()
    assert report.stats["setup"]["source"] == "trainer"
    assert torch.equal(rng[0], torch.get_rng_state())
    assert rng[1] == random.getstate() and np.array_equal(rng[2], np.random.get_state()[1])
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())
    assert trainer.model is model and trainer.optimizer is None and trainer.lr_scheduler is None
    assert trainer.state.global_step == 0
    assert trainer.args.weight_decay == 0.1 and trainer.args.learning_rate == 1e-2
    assert model.config.attention_dropout == 0.1
    assert all(m.attention_dropout == 0.1 for m in model.modules() if hasattr(m, "attention_dropout"))
    assert modes == [m.training for m in model.modules()]
    assert hooks == sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.slow  # the whole protocol on a Trainer (the fast lane runs it on a model, above)
def test_sft_trainer_passes_and_is_left_untouched(model, tmp_path):
    from trl import SFTConfig, SFTTrainer

    from hf_sanity.testing import build_tokenizer

    tok = build_tokenizer("chatml", "distinct")
    config = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, report_to=[],
                       use_cpu=True, save_strategy="no", max_length=128, learning_rate=1e-2,
                       dataset_num_proc=None)  # fmt: skip
    trainer = SFTTrainer(model=model, args=config, processing_class=tok,
                         train_dataset=datasets.Dataset.from_list(demo_conversations(16)))  # fmt: skip
    metrics = copy.deepcopy(dict(trainer._metrics))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = diagnose(trainer=trainer, write_repro=False)
    assert not report.has_errors, [f.message for f in report.findings]
    assert report.stats["overfit"]["passed"] and report.stats["broken_layer"] is None
    # TRL wraps model.forward on the instance, the original forward in its closure: the copies run their own
    # modules (the shape table sees every layer), never the user's model
    assert "model.layers.*.mlp.down_proj" in {row["module"] for row in report.stats["shapes"]}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # SFTTrainer.compute_loss logs metrics into the trainer: into a copy of it, not the user's
    assert dict(trainer._metrics) == metrics


# -- planted bugs, one cause each ------------------------------------------------------------------
def test_no_trainable_params(model, tok):
    model.requires_grad_(False)
    report = overfit(model=model, tokenizer=tok, dataset=demo_conversations(8), lr=1e-2)
    assert cause(report) == "no-trainable-params"
    assert report.exit_code == 1
    assert report.stats["overfit"]["steps_run"] <= 20  # the measurement decided it; training only confirms


def test_optimizer_over_a_subset_of_the_params(model, tok, tmp_path):
    """An optimizer that holds only the final norm (64 of 202k weights) cannot memorise the examples: named.
    (One over every norm, 320 weights, memorises them in 45 steps at lr 1, within --steps 100: that overfit
    passes, as it should.)"""
    norms = [p for n, p in model.named_parameters() if n == "model.norm.weight"]
    trainer = make_trainer(model, tok, tmp_path, optimizer=torch.optim.AdamW(norms, lr=1e-2))
    report = overfit(trainer=trainer, steps=100)
    assert cause(report) == "params-not-in-optimizer"
    finding = report.by_rule("overfit-failed")[0]
    assert "model.embed_tokens.weight" in report.stats["overfit"]["gradient_path"]["not_in_optimizer"]
    assert finding.evidence["in_optimizer"] == len(norms)
    assert "not in the optimizer" in finding.message


def no_search_ran(report) -> bool:
    """The cause came from the first step: no LR was searched, only the short confirmation run followed."""
    stats = report.stats["overfit"]
    return stats["lr_search"] is None and stats["lr_chosen_by"] == "default" and stats["steps_run"] <= 20


def test_optimizer_built_before_the_adapter_holds_none_of_its_params(tmp_path):
    report = overfit(**broken_setup(str(tmp_path)))
    assert cause(report) == "params-not-in-optimizer" and no_search_ran(report)
    path = report.stats["overfit"]["gradient_path"]
    assert path["in_optimizer"] == 0 and path["trainable"] > 0 and path["optimizer_frozen"] > 0


def test_detached_loss(model, tok, tmp_path):
    class DetachingTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss.detach().requires_grad_(True)  # backward() runs, and reaches nothing

    report = overfit(trainer=make_trainer(model, tok, tmp_path, cls=DetachingTrainer))
    assert cause(report) == "loss-not-connected" and no_search_ran(report)
    path = report.stats["overfit"]["gradient_path"]
    assert path["loss_grad_fn"] is None and path["loss_requires_grad"] is True
    assert report.stats["overfit"]["loss_final"] == pytest.approx(report.stats["overfit"]["loss_start"])


class CompletionOnlyCollator:
    """The pre-0.20 TRL recipe: mask everything up to the response template; rows without it lose all labels."""

    def __init__(self, tokenizer, response_template: str):
        self.tokenizer = tokenizer
        self.template = tokenizer(response_template, add_special_tokens=False)["input_ids"]

    def __call__(self, features):
        batch = self.tokenizer.pad([{"input_ids": f["input_ids"]} for f in features], return_tensors="pt")
        labels = batch["input_ids"].clone()
        width = len(self.template)
        for row in range(labels.shape[0]):
            ids = batch["input_ids"][row].tolist()
            starts = [i for i in range(len(ids) - width + 1) if ids[i : i + width] == self.template]
            labels[row, : starts[0] + width if starts else len(ids)] = -100
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch


def test_labels_all_masked_by_a_wrong_response_template(model, tok, tmp_path):
    rows = datasets.Dataset.from_list(
        [{"input_ids": tok.apply_chat_template(r["messages"])["input_ids"]} for r in demo_conversations(16)]
    )
    collator = CompletionOnlyCollator(tok, "### Answer:")  # a Llama-2-era template on ChatML data
    report = overfit(trainer=make_trainer(model, tok, tmp_path, collator=collator, train=rows))
    assert cause(report) == "labels-masked" and no_search_ran(report)
    assert report.stats["overfit"]["gradient_path"]["supervised_tokens"] == 0
    assert report.stats["overfit"]["gradient_path"]["label_positions"] > 0


@pytest.mark.planted("overfit-failed")
def test_zero_gradient_through_a_path_multiplied_by_zero(model, tok):
    model.lm_head.register_forward_hook(lambda module, args, output: output * 0)  # e.g. a scale left at 0
    report = overfit(model=model, tokenizer=tok, dataset=demo_conversations(8), lr=1e-2)
    assert cause(report) == "no-gradient"
    grads = report.by_rule("overfit-failed")[0].evidence["grads"]
    assert grads["nonzero"] == 0 and grads["zero"] > 0


class PositionsOnly(torch.nn.Module):
    """A custom model with a bug: it embeds the positions where it meant the tokens. Gradients flow and the
    loss falls, to the per-position average of the examples, never to zero."""

    def __init__(self, vocab: int, width: int = 32):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(512, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, labels=None):
        import types

        steps = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.positions(steps).expand(input_ids.shape[0], -1, -1)  # the bug: self.tokens(input_ids)
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return types.SimpleNamespace(loss=loss, logits=logits)


def test_a_model_that_ignores_its_input_is_named_not_an_lr_problem(tok):
    """The LR search would call it not-converged and point at capacity; the probe knows the input never
    reaches the model."""
    torch.manual_seed(0)
    report = overfit(model=PositionsOnly(len(tok)), tokenizer=tok, dataset=demo_conversations(8), steps=60)
    assert cause(report) == "input-ignored"
    finding = report.by_rule("overfit-failed")[0]
    assert finding.evidence["input_ignored"] is True and "input_ids" in finding.fix


def test_optimizer_step_that_updates_nothing(model, tok, tmp_path):
    class LoggingAdamW(torch.optim.AdamW):
        def step(self, closure=None):  # a wrapper meant to log the step, that never calls the real one
            return None

    trainer = make_trainer(model, tok, tmp_path, optimizer=LoggingAdamW(model.parameters(), lr=1e-2))
    report = overfit(trainer=trainer, steps=50)
    assert cause(report) == "no-update" and no_search_ran(report)
    assert report.stats["overfit"]["gradient_path"]["updated"] == 0
    assert report.stats["overfit"]["gradient_path"]["optimizer"] == "LoggingAdamW"


def test_a_trainer_that_already_trained_is_overfit_with_the_optimizer_inside_accelerates_wrapper(
    model, tok, tmp_path
):
    """After train(), trainer.optimizer is accelerate's AcceleratedOptimizer around the AdamW (its __init__ takes
    the optimizer it wraps): the copy is trained with a fresh AdamW built by AdamW's own constructor, and the LR
    the schedule started from is the configured one (not where it decayed to)."""
    trainer = make_trainer(model, tok, tmp_path, lr_scheduler_type="linear", learning_rate=3e-3)
    trainer.train()
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"
    report = overfit(trainer=trainer, steps=60, lr=3e-3)
    assert report.by_rule("overfit-failed") == [] and report.stats["overfit"]["passed"]
    assert report.stats["setup"]["optimizer"] == "AdamW"
    assert report.stats["setup"]["configured_lr"] == pytest.approx(3e-3)


class WarmupSGD(torch.optim.SGD):
    """SGD whose constructor matters: it keeps its own argument in ``defaults`` (as torch's optimizers do) and
    sets up the step counter its ``step`` reads."""

    def __init__(self, params, lr=1e-2, momentum=0.0, *, warmup_steps: int):
        super().__init__(params, lr=lr, momentum=momentum)
        self.defaults["warmup_steps"] = warmup_steps
        self.steps_done = 0

    def step(self, closure=None):
        self.steps_done += 1
        scale = min(1.0, self.steps_done / self.defaults["warmup_steps"])
        lrs = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] *= scale
        try:
            return super().step(closure)
        finally:
            for group, lr in zip(self.param_groups, lrs):
                group["lr"] = lr


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al., 2019) around a base optimizer: its constructor takes the optimizer it wraps, not
    parameters, so no fresh one can be built from param groups and defaults."""

    def __init__(self, base_optimizer, k: int = 5, alpha: float = 0.5):
        self.base_optimizer, self.k, self.alpha, self.steps_done = base_optimizer, k, alpha, 0
        self.param_groups, self.defaults, self.state = (
            base_optimizer.param_groups, base_optimizer.defaults, base_optimizer.state
        )  # fmt: skip
        self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

    def step(self, closure=None):
        loss = self.base_optimizer.step(closure)
        self.steps_done += 1
        if self.steps_done % self.k == 0:
            fast = [p for g in self.param_groups for p in g["params"]]
            with torch.no_grad():
                for slow, p in zip(self.slow, fast):
                    slow += self.alpha * (p - slow)
                    p.copy_(slow)
        return loss


def test_the_users_optimizer_is_rebuilt_by_its_own_constructor(model, tok, tmp_path):
    optimizer = WarmupSGD(model.parameters(), lr=0.3, momentum=0.9, warmup_steps=4)
    from hf_sanity.protocol.optimizers import remap_optimizer

    twin = copy.deepcopy(model)
    rebuilt = remap_optimizer(optimizer, model, twin, lr=0.1)
    assert type(rebuilt) is WarmupSGD and rebuilt.steps_done == 0  # its __init__ ran
    assert rebuilt.defaults["warmup_steps"] == 4 and rebuilt.param_groups[0]["momentum"] == 0.9
    assert rebuilt.param_groups[0]["lr"] == 0.1 and rebuilt.state == {}
    assert {id(p) for p in rebuilt.param_groups[0]["params"]} == {id(p) for p in twin.parameters()}
    trainer = make_trainer(model, tok, tmp_path, optimizer=optimizer)
    report = overfit(trainer=trainer, steps=60, lr=0.3)
    assert report.stats["setup"]["optimizer"] == "WarmupSGD" and report.by_rule("overfit-failed") == []


def test_an_optimizer_that_cannot_be_rebuilt_is_said_in_one_line(model, tok, tmp_path):
    """Not an object assembled without its constructor (it would step without its base optimizer): bad input."""
    optimizer = Lookahead(torch.optim.AdamW(model.parameters(), lr=1e-2))
    trainer = make_trainer(model, tok, tmp_path, optimizer=optimizer)
    with pytest.raises(
        UserInputError, match=r"cannot rebuild the optimizer Lookahead .* raised AttributeError"
    ) as info:
        overfit(trainer=trainer, steps=20, lr=1e-2)
    assert "\n" not in str(info.value)


# -- the overfit LR --------------------------------------------------------------------------------
def assert_searched_and_reached(stats, steps):
    """The LR was searched, the run shown is the search's last and reached near zero, within 3 step budgets."""
    search = stats["lr_search"]
    assert stats["passed"] and stats["lr_chosen_by"] == "search"
    assert stats["lr"] == pytest.approx(search["tried"][-1]["lr"], rel=1e-3)
    assert search["tried"][-1]["ended"] == "near zero" and stats["loss_final"] <= stats["near_zero"]
    assert search["steps"] <= 3 * steps and search["step_limit"] == 4 * steps


@pytest.mark.slow  # 300-step runs and an LR search
@pytest.mark.clean("overfit-failed")
def test_clean_full_fine_tune_overfits_with_the_default_options(model, tok):
    """The protocol's order on a correct setup: step 1 at the fixed full fine-tuning LR (1e-4) does not get the
    random tiny model near zero (6.9 -> ~3 in 300 steps), with the gradient path intact; steps 2 and 3 run and
    pass; only then does step 4 search the LR, and the search gets there. No finding: the overfit passes, at
    the LR the search reports."""
    report = overfit(model=model, tokenizer=tok, dataset=demo_conversations(16))
    assert not report.has_errors, report.summary()
    stats = report.stats["overfit"]
    assert_searched_and_reached(stats, 300)
    assert stats["step1"]["lr"] == 1e-4 and stats["step1"]["steps_run"] == 300
    assert stats["step1"]["loss_final"] > stats["near_zero"] == 0.05
    assert stats["gradient_path"]["grads"]["nonzero"] == stats["gradient_path"]["trainable"] == 21
    assert stats["lr"] > 1e-3  # well above step 1's: the one the search found and reports
    assert report.stats["setup"]["lr"] == stats["lr"] and report.stats["setup"]["lr_search"] is True
    # steps 2 and 3 ran (their measurements are in the report) before step 4's search, in the protocol's order
    assert "init_loss" in report.stats and "masks" in report.stats
    layers = [i["layer"] for i in report.stats["checklist"]]
    assert layers == sorted(layers) and set(layers) == {1, 2, 3, 4}
    [first] = [
        i for i in report.stats["checklist"] if i["item"] == "the loss reaches near zero at the step-1 LR"
    ]
    assert first["status"] == "warning" and "lr=0.0001" in first["detail"]
    [found] = [
        i for i in report.stats["checklist"] if i["item"] == "the overfit reaches near zero at a searched LR"
    ]
    assert found["status"] == "passed" and f"lr={stats['lr']:.3g}" in found["detail"]
    assert stats["trajectory"][0] == [0, pytest.approx(stats["loss_start"], abs=1e-4)]
    assert stats["trajectory"][-1][0] == stats["reached_at_step"]


@pytest.mark.slow  # an LR search
def test_lora_adapter_overfits_with_the_default_options(model, tok):
    """With 100 steps the old adapter default (lr=1e-3) does not get there (it needs ~200); the search does."""
    lora = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "lm_head"]}
    report = overfit(model=model, tokenizer=tok, dataset=demo_conversations(16), lora=lora, steps=100)
    assert not report.has_errors, report.summary()
    stats = report.stats["overfit"]
    assert_searched_and_reached(stats, 100)
    assert report.stats["setup"]["adapter"] == "LORA"


def test_a_given_lr_is_used_as_is(model, tok):
    report = overfit(model=model, tokenizer=tok, dataset=demo_conversations(8), lr=1e-4, steps=50)
    stats = report.stats["overfit"]
    assert stats["lr"] == 1e-4 and stats["lr_chosen_by"] == "given" and stats["lr_search"] is None
    assert stats["steps_run"] == 50 and cause(report) == "not-converged"
    [finding] = report.by_rule("overfit-failed")
    assert finding.evidence["lr"] == 1e-4 and "lrs_tried" not in finding.evidence
    assert "Rerun without --lr" in finding.fix


class ShufflingTrainer(Trainer):
    """Labels shuffled across the examples at every step: no LR can make the model memorise them."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        inputs = {**inputs, "labels": labels[torch.randperm(labels.shape[0], device=labels.device)]}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.slow  # 300-step runs and an LR search
def test_labels_that_cannot_be_memorised_fail_after_a_wide_lr_search(model, tok, tmp_path):
    report = overfit(trainer=make_trainer(model, tok, tmp_path, cls=ShufflingTrainer), steps=100)
    assert cause(report) == "not-converged"
    [finding] = report.by_rule("overfit-failed")
    stats = report.stats["overfit"]
    tried = finding.evidence["lrs_tried"]  # [lr, best loss] of every run, in the order they ran
    assert len(tried) >= 3 and max(lr for lr, _ in tried) >= 10 * min(lr for lr, _ in tried)
    assert all(best > stats["near_zero"] for _, best in tried)
    assert finding.evidence["lr_chosen_by"] == "search"
    assert any(lr == pytest.approx(finding.evidence["lr"], rel=0.01) for lr, _ in tried)  # the best run's
    assert f"{len(tried)} LRs tried" in finding.message and "cannot be memorised" in finding.fix
    assert stats["lr_search"]["steps"] <= 4 * 100
    # `--steps 100` means 100: the best LR's run was not left where the search cut it (it stopped at 51 and
    # advised "more --steps")
    assert stats["steps_run"] == stats["step_budget"] == 100 and "more --steps" in finding.fix
    assert stats["gradient_path"]["grads"]["nonzero"] == 21  # the gradient path itself is fine


class RandomLabelsTrainer(Trainer):
    """Every supervised label drawn at random at every step: nothing can be memorised, whatever trains."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"].clone()
        kept = labels != -100
        labels[kept] = torch.randint(4, model.config.vocab_size, (int(kept.sum()),), device=labels.device)
        return super().compute_loss(model, {**inputs, "labels": labels}, return_outputs, num_items_in_batch)


@pytest.mark.slow
def test_an_adapter_on_labels_nothing_can_learn_is_not_called_capacity(model, tok, tmp_path):
    """The capacity check's twin: the same small adapter (LoRA r=1 on q_proj) on labels drawn at random each
    step. No LR helps, and with every weight trainable it gets no nearer either: not-converged, not capacity."""
    from peft import LoraConfig, get_peft_model

    adapter = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules=["q_proj"]))
    trainer = make_trainer(adapter, tok, tmp_path, cls=RandomLabelsTrainer)
    report = overfit(trainer=trainer, steps=40)
    assert cause(report) == "not-converged"
    [finding] = report.by_rule("overfit-failed")
    assert "not a matter of capacity" in finding.message
    capacity = report.stats["overfit"]["capacity"]  # the check ran
    assert capacity["trainable_elements"] == 256 and not capacity["all_trainable_reached"]
    assert capacity["all_trainable_best_loss"] > 0.5 * report.stats["overfit"]["loss_start"]


def rows_with_empty_masks(tok):
    """A third of the rows carry no supervised token."""
    data = token_rows(tok, 12)
    return [
        {"input_ids": ids, "labels": [-100] * len(ids) if i % 3 == 0 else labels}
        for i, (ids, labels) in enumerate(zip(data["input_ids"], data["labels"]))
    ]


@pytest.mark.slow  # 300-step runs and an LR search
@pytest.mark.planted("overfit-failed")
def test_shapes_and_masks_run_before_any_lr_search(model, tok):
    """The protocol's order: step 1 at the fixed LR does not reach near zero (gradient path intact); step 3 then
    finds rows without a supervised token, and the LR is not searched ("run steps 1 through 3 first, every time,
    before touching the optimizer"). It used to search the LR first, pass the overfit there, and only then name
    the masks."""
    report = diagnose(model=model, tokenizer=tok, dataset=rows_with_empty_masks(tok), write_repro=False)
    stats = report.stats
    assert stats["broken_layer"] == "3. shapes and masks" and stats["cause"] == "empty-loss-mask"
    assert stats["overfit"]["lr_search"] is None and "lr_range" not in stats  # no LR was touched
    assert stats["overfit"]["found_before_lr"] == ["empty-loss-mask"]
    [finding] = report.by_rule("empty-loss-mask")
    assert finding.severity == "error" and finding.evidence["count"] == 3  # rows 0, 3 and 6 of the 8
    assert report.by_rule("overfit-failed") == []  # diagnose's verdict is the broken layer
    assert [i["status"] for i in stats["checklist"] if i["layer"] == 1][-1] == "warning"
    [masks] = [i for i in stats["checklist"] if i["layer"] == 3 and i["item"].startswith("masks")]
    assert masks["status"] == "failed" and "empty-loss-mask" in masks["detail"]
    assert [i["status"] for i in stats["checklist"] if i["layer"] > 3] == ["skipped"] * 2
    # overfit itself stops at the same place, and says why the LR was not searched
    report = overfit(model=model, tokenizer=tok, dataset=rows_with_empty_masks(tok))
    assert cause(report) == "not-converged" and report.by_rule("empty-loss-mask")
    [finding] = report.by_rule("overfit-failed")
    assert finding.evidence["found_before_lr"] == ["empty-loss-mask"] and "not searched" in finding.message
    assert report.stats["overfit"]["lr_search"] is None


@pytest.mark.clean("overfit-failed")
@pytest.mark.parametrize(
    "start", [0, pytest.param(8, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow)]
)
def test_a_setup_that_overfits_at_the_step1_lr_passes_near_zero_as_written(model, tok, start):
    """Near zero is 0.05 nat/token, as the protocol writes it. At lr 1e-3 the tiny full fine-tune gets there
    within 300 steps on several draws of eight examples: step 1 passes, nothing else runs."""
    report = overfit(model=model, tokenizer=tok, dataset=demo_conversations(32)[start:], lr=1e-3)
    stats = report.stats["overfit"]
    assert report.findings == [] and stats["passed"] and stats["lr_search"] is None, report.summary()
    assert stats["near_zero"] == 0.05 and stats["loss_final"] <= 0.05 and stats["data_floor"] is None
    assert "init_loss" not in report.stats  # step 1 decided
    assert stats["trajectory"][-1] == [stats["reached_at_step"], pytest.approx(stats["loss_final"], abs=1e-4)]


@pytest.mark.planted("overfit-failed")
def test_near_zero_means_near_zero(model, tok):
    """100 steps at lr 1e-3 leave the loss at ~0.18 nat/token: every answer token at ~83%. The old threshold
    (5% of the step-0 loss, 0.35 here) passed it; the protocol's "nearly zero" (its example ends at 0.012) does
    not."""
    report = overfit(model=model, tokenizer=tok, dataset=demo_conversations(16), lr=1e-3, steps=100)
    assert cause(report) == "not-converged"
    stats = report.stats["overfit"]
    assert 0.05 < stats["loss_final"] < 0.05 * stats["loss_start"]  # passed before, fails now
    [finding] = report.by_rule("overfit-failed")
    assert finding.evidence["near_zero"] == 0.05 and "not near zero (0.05)" in finding.message
    assert "init_loss" in report.stats and "masks" in report.stats  # steps 2 and 3 ran before the verdict


NUMBER_WORDS = ["three", "seven", "five", "nine", "two", "eight", "four", "six"]


def same_prompt_rows(words=NUMBER_WORDS) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": "Pick a number from one to nine."},
                {"role": "assistant", "content": w},
            ]
        }
        for w in words
    ]


@pytest.mark.planted("overfit-failed")
def test_the_floor_the_data_imposes_is_computed_and_shown(model, tok):
    """Eight identical prompts with eight different answers: no model can predict which, so 0.05 nat/token is
    out of reach; near zero is the data's floor (the entropy of the answers after the identical prompt, per
    supervised token) plus 0.05, and the report says so. Without it, the overfit would fail a correct setup."""
    report = overfit(model=model, tokenizer=tok, dataset=same_prompt_rows(), lr=1e-2, steps=200)
    stats = report.stats["overfit"]
    floor = stats["data_floor"]
    assert report.findings == [] and stats["passed"], report.summary()
    assert floor["nats"] > 0.3 and floor["positions"] > 0 and floor["prefixes"] >= 1
    assert stats["near_zero"] == pytest.approx(floor["nats"] + 0.05, abs=1e-3)
    assert floor["nats"] - 1e-3 <= stats["loss_final"] <= stats["near_zero"]
    assert stats["loss_final"] > 0.05  # the old "near zero" could not be reached here
    text = io.StringIO()
    Console(file=text, width=200).print(report)
    assert "near zero is the data's floor" in text.getvalue()
    # one answer repeated eight times: no conflict, no floor
    report = overfit(model=model, tokenizer=tok, dataset=same_prompt_rows(["seven"] * 8), lr=1e-2, steps=200)
    assert report.stats["overfit"]["data_floor"] is None and report.stats["overfit"]["near_zero"] == 0.05


# -- layers ----------------------------------------------------------------------------------------
@pytest.mark.planted("precision-mismatch")
def test_precision_catches_a_planted_fp16_overflow_and_is_silent_on_the_clean_model(model, tok):
    if half_support(torch.device("cpu"))["float16"] is not None:
        pytest.skip("fp16 autocast is not available on this CPU")
    clean = from_objects(model, tok, demo_conversations(8), lr=1e-2)
    run, _ = run_precision(clean)
    from hf_sanity.rules.protocol import check_precision

    assert check_precision(run) == [] and set(run.half) == {"bfloat16", "float16"}
    hot = copy.deepcopy(model)
    # weights within fp16's range (65504), activations beyond it; float32 and bf16 have the range
    with torch.no_grad():
        hot.model.layers[1].mlp.up_proj.weight.mul_(1e4)
        hot.model.layers[1].mlp.down_proj.weight.mul_(1e4)
    assert max(float(p.abs().max()) for p in hot.parameters()) < torch.finfo(torch.float16).max
    run, stats = run_precision(from_objects(hot, tok, demo_conversations(8), lr=1e-2))
    findings = check_precision(run)
    assert [f.evidence["dtype"] for f in findings] == ["float16"]
    assert findings[0].rule == "precision-mismatch" and findings[0].severity == "error"
    assert findings[0].evidence["first_overflow"].startswith("model.layers.1.mlp.down_proj ")
    assert math.isfinite(run.fp32) and stats["half"]["bfloat16"]["status"] == "passed"


def test_diagnose_stops_at_the_broken_layer_and_saves_a_reproduction(model, tok):
    from pathlib import Path

    from safetensors.torch import load_file

    masked = [{"input_ids": ids, "labels": [-100] * len(ids)} for ids in token_rows(tok, 8)["input_ids"]]
    report = diagnose(model=model, tokenizer=tok, dataset=masked, lr=1e-2)
    assert report.stats["broken_layer"] == "1. overfit one batch" and report.stats["cause"] == "labels-masked"
    skipped = [i for i in report.stats["checklist"] if i["layer"] > 1]
    assert [i["layer"] for i in skipped] == [2, 3, 4, 5]
    assert all(i["status"] == "skipped" and "layer 1" in i["detail"] for i in skipped)
    folder = Path(report.stats["repro"]["folder"])
    assert folder.parent == Path.cwd() / "hf-sanity-repro"  # a fresh folder under the current directory
    tensors = load_file(str(folder / "batch.safetensors"))
    assert set(tensors) == {"0.input_ids", "0.attention_mask", "0.labels"}
    assert bool((tensors["0.labels"] == -100).all()) and tensors["0.input_ids"].shape[0] == 8
    assert (folder / "reproduce.py").is_file() and "reproduce.py" in report.stats["repro"]["command"]
    text = io.StringIO()
    Console(file=text, width=120).print(report)
    assert "broken at layer 1 (overfit one batch): labels all masked" in text.getvalue()
    assert "not run: layer 1" in text.getvalue()


def test_reproduction_never_goes_into_the_model_folder(model, tok):
    from hf_sanity.testing import tiny_model_dir

    inside = tiny_model_dir("chatml", "distinct") / "repro"
    with pytest.raises(UserInputError, match="never writes into the model"):
        diagnose(model=model, tokenizer=tok, dataset=demo_conversations(8), lr=1e-2, repro=inside)
    assert not inside.exists()


def test_bad_options_are_user_errors(model, tok):
    with pytest.raises(UserInputError, match="between 2 and 10"):
        overfit(model=model, tokenizer=tok, dataset=demo_conversations(8), n=11)
    with pytest.raises(UserInputError, match="--steps"):
        overfit(model=model, tokenizer=tok, dataset=demo_conversations(8), steps=0)
    with pytest.raises(UserInputError, match="trainer="):
        overfit(model=model)


def test_demo_names_the_broken_layer_quickly():
    started = time.perf_counter()
    out = io.StringIO()
    report = demo_diagnose(Console(file=out, width=100))
    assert time.perf_counter() - started < 30
    assert report.stats["broken_layer"] == "1. overfit one batch"
    assert report.stats["cause"] == "params-not-in-optimizer"
    text = out.getvalue()
    assert "broken at layer 1 (overfit one batch)" in text and "params not in the optimizer" in text
    assert "verification checklist" in text
