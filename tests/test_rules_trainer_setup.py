"""preflight(trainer=...): the exact collated batches, and the trainer-setup rules, on real Trainers."""

import copy

import datasets
import pytest
import torch
import trl_setups as setups
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from hf_sanity.drivers.preflight import preflight
from hf_sanity.testing import as_prompt_completion, demo_conversations, tiny_setup

SETUP_RULES = ["packing-contamination", "grad-accum-loss-scaling", "checkpointing-blocks-grads"]


def args(tmp_path, **kwargs):
    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                save_strategy="no", seed=0)  # fmt: skip
    return TrainingArguments(**{**base, **kwargs})


def token_rows(tok, n=16):
    return datasets.Dataset.from_list(
        [{"input_ids": tok.apply_chat_template(r["messages"])["input_ids"]} for r in demo_conversations(n)]
    )


@pytest.fixture
def model_tok():
    model, tok = tiny_setup("chatml", "eos")
    return copy.deepcopy(model), tok


def sft(tmp_path, model, tok, rows, **config):
    from trl import SFTConfig, SFTTrainer

    if rows and isinstance(rows[0].get("prompt"), list):  # conversational prompt-completion rows
        setups.skip_where_trl_trains_the_prompt()

    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                save_strategy="no", max_length=128, dataset_num_proc=None)  # fmt: skip
    return SFTTrainer(model=model, args=SFTConfig(**{**base, **config}), train_dataset=datasets.Dataset.from_list(rows),
                      processing_class=tok)  # fmt: skip


def test_pad_equal_eos_collator_trap_on_a_plain_trainer(tmp_path, model_tok):
    model, tok = model_tok
    trainer = Trainer(model=model, args=args(tmp_path), train_dataset=token_rows(tok),
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))  # fmt: skip
    state = torch.get_rng_state()
    report = preflight(trainer=trainer, use_config=False)
    assert torch.equal(state, torch.get_rng_state())  # drawing batches did not move the user's RNG
    assert {f.rule for f in report.findings} >= {"eos-not-learned", "prompt-in-loss"}
    eos = report.by_rule("eos-not-learned")[0]
    assert eos.evidence["pad_is_eos"] is True


@pytest.mark.parametrize("mode", ["assistant_only", "completion_only", "packed"])
@pytest.mark.clean("trainer", "tokens", "packing-contamination")
def test_clean_sft_trainer_runs_are_silent(tmp_path, mode):
    from hf_sanity.testing import build_tokenizer

    model, _ = tiny_setup("generation", "eos")
    tok = build_tokenizer("generation", "eos")
    rows = demo_conversations(24)
    if mode == "assistant_only":
        trainer = sft(tmp_path, copy.deepcopy(model), tok, rows, assistant_only_loss=True)
    elif mode == "completion_only":
        trainer = sft(tmp_path, copy.deepcopy(model), tok, as_prompt_completion(rows, conversational=True))
    else:
        trainer = sft(
            tmp_path, copy.deepcopy(model), tok, as_prompt_completion(rows, conversational=True), packing=True
        )
    report = preflight(trainer=trainer, use_config=False)
    assert [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"] == []


@pytest.mark.planted("packing-contamination")
def test_packing_without_isolation(tmp_path, model_tok):
    model, tok = model_tok
    rows = as_prompt_completion(demo_conversations(24), conversational=True)
    trainer = sft(tmp_path, model, tok, rows, packing=True)
    clean = preflight(trainer=trainer, select=SETUP_RULES, use_config=False)
    assert clean.findings == []  # position ids restart per example: transformers isolates them

    class NoPositions:  # a collator that drops position_ids: the packed examples now see each other
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, examples):
            batch = self.inner(examples)
            batch.pop("position_ids")
            return batch  # seq_idx / cu_seq_lens still say where the examples are

    trainer.data_collator = NoPositions(trainer.data_collator)
    (finding,) = preflight(trainer=trainer, select="packing-contamination", use_config=False).findings
    if (
        "keys" in finding.evidence
    ):  # TRL 1.9's collator marks the examples by position_ids alone: none is left
        import trl
        from packaging.version import Version

        assert Version(trl.__version__) < Version(setups.NEWEST_TRL), finding.evidence
        assert (
            not {"seq_idx", "cu_seq_lens_q"} & set(finding.evidence["keys"])
            and "no example" in finding.message
        )
        return
    assert finding.evidence["position_ids"] is False and finding.evidence["max_logit_difference"] > 0


TOKEN_RULES = {"eos-not-learned", "prompt-in-loss", "generation-prompt-mismatch", "truncated-completion",
               "empty-loss-mask", "duplicate-examples", "completion-masked"}  # fmt: skip


def packed_run(tmp_path, model, tok, strategy, max_length, collator=None):
    """SFTTrainer with packing `strategy` on conversational prompt/completion rows (pad == EOS): preflight on
    its batches, then a real run with the callback. Both reports."""
    from hf_sanity.callback import SanityCallback

    setups.skip_where_trl_trains_the_prompt()
    rows = as_prompt_completion(demo_conversations(48), conversational=True)
    trainer = sft(tmp_path, model, tok, rows, packing=True, packing_strategy=strategy, max_length=max_length,
                  max_steps=3, disable_tqdm=True)  # fmt: skip
    if collator is not None:
        trainer.data_collator = collator(trainer.data_collator)
    before = preflight(trainer=trainer, use_config=False)
    watch = SanityCallback(use_config=False, print_findings=False)
    trainer.add_callback(watch)
    trainer.train()
    return before, watch.report


def above_info(report) -> dict:
    return {f.rule: f for f in report.findings if f.severity != "info"}


@pytest.mark.clean("eos-not-learned", "prompt-in-loss", "empty-loss-mask", "duplicate-examples")
@pytest.mark.parametrize("strategy, max_length", [("wrapped", 64), ("bfd_split", 32)])
def test_answers_the_packing_splits_across_rows_are_not_unlearned_ends(
    tmp_path, model_tok, strategy, max_length
):
    """TRL's "wrapped" packing cuts the stream of examples every max_length tokens, "bfd_split" splits the
    longer examples into pieces: a row starts inside an answer begun in the row before, or ends inside one the
    next row goes on with. That is not an end of turn without loss (pad == EOS here), a prompt in the loss, a
    generation prompt that differs, or an example without loss; "wrapped" is packing-contamination (nothing
    isolates the examples), and preflight and the callback agree on the rest."""
    model, tok = model_tok
    before, during = packed_run(tmp_path, model, tok, strategy, max_length)
    expected = {"packing-contamination"} if strategy == "wrapped" else set()
    assert set(above_info(before)) == expected, [f.message for f in before.findings]
    assert set(above_info(during)) == set(), [f.message for f in during.findings]
    assert before.stats["supervised_tokens"] > 0  # the token rules ran on rows that carry loss


@pytest.mark.planted("eos-not-learned")
def test_an_end_of_turn_masked_inside_packed_rows_is_still_caught(tmp_path, model_tok):
    """The same packed run with a collator that masks every pad id (== EOS) in the labels: the ends of turn
    inside the rows carry no loss. Caught before training and at the first step, pad == EOS named."""
    model, tok = model_tok

    class MaskPadIds:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, examples):
            batch = self.inner(examples)
            batch["labels"][batch["input_ids"] == tok.pad_token_id] = -100
            return batch

    before, during = packed_run(tmp_path, model, tok, "wrapped", 64, collator=MaskPadIds)
    for report in (before, during):
        found = above_info(report)
        assert found.keys() & TOKEN_RULES == {"eos-not-learned"}, [f.message for f in report.findings]
        assert found["eos-not-learned"].evidence["pad_is_eos"] is True
        assert found["eos-not-learned"].evidence["completions_without_end"] == 0


@pytest.mark.planted("grad-accum-loss-scaling")
def test_custom_loss_that_ignores_num_items(tmp_path, model_tok):
    model, tok = model_tok

    class MeanLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            logits = outputs.logits[:, :-1]
            labels = inputs["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
            return (loss, outputs) if return_outputs else loss

    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    bad = MeanLossTrainer(model=model, args=args(tmp_path, gradient_accumulation_steps=4),
                          train_dataset=token_rows(tok), data_collator=collator)  # fmt: skip
    (finding,) = preflight(trainer=bad, select="grad-accum-loss-scaling", use_config=False).findings
    assert finding.evidence["gradient_accumulation_steps"] == 4
    good = Trainer(model=model, args=args(tmp_path, gradient_accumulation_steps=4), train_dataset=token_rows(tok),
                   data_collator=collator)  # fmt: skip
    assert preflight(trainer=good, select="grad-accum-loss-scaling", use_config=False).findings == []


@pytest.mark.planted("checkpointing-blocks-grads")
def test_reentrant_checkpointing_with_frozen_embeddings(tmp_path, model_tok):
    from peft import LoraConfig, get_peft_model

    model, tok = model_tok
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    # transformers and peft each hook the embeddings so their output requires grad; without that, reentrant
    # checkpointing cuts the graph (as with models or versions that do not add the hook).
    hooks = model.get_input_embeddings()._forward_hooks
    for key in [k for k, fn in hooks.items() if fn.__name__ == "make_inputs_require_grads"]:
        del hooks[key]
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    trainer = Trainer(model=lora, args=args(tmp_path), train_dataset=token_rows(tok), data_collator=collator)
    before = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    (finding,) = preflight(trainer=trainer, select="checkpointing-blocks-grads", use_config=False).findings
    assert finding.evidence["trainable_tensors"] == 8
    assert all(p.grad is None for p in lora.parameters())  # the measurement left no gradients behind
    assert all(torch.equal(before[n], p) for n, p in lora.named_parameters() if p.requires_grad)
    lora.enable_input_require_grads()
    assert preflight(trainer=trainer, select="checkpointing-blocks-grads", use_config=False).findings == []


@pytest.mark.clean("checkpointing-blocks-grads")
def test_checkpointing_is_read_without_the_deprecated_name(tmp_path, model_tok):
    """transformers 5 warns on `is_gradient_checkpointing`; hf-sanity reads `is_activation_checkpointing`, so a
    preflight on a trainer with checkpointing on prints no deprecation warning of a library."""
    import warnings

    model, tok = model_tok
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    trainer = Trainer(model=model, args=args(tmp_path), train_dataset=token_rows(tok), data_collator=collator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = preflight(trainer=trainer, select="checkpointing-blocks-grads", use_config=False)
    assert report.findings == []
    assert [str(w.message) for w in caught if "deprecated" in str(w.message)] == []


@pytest.mark.planted("init-loss-off-chance")
def test_a_compute_loss_that_scales_the_loss_is_judged_before_training(tmp_path, model_tok):
    """preflight(trainer=...) judges the loss the trainer computes, not only the model's own: a compute_loss
    that returns 10x the cross-entropy starts at ~69 against ln(V) = 6.9."""
    model, tok = model_tok

    class ScaledLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            return loss * 10

    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    scaled = ScaledLossTrainer(
        model=model, args=args(tmp_path), train_dataset=token_rows(tok), data_collator=collator
    )
    (finding,) = preflight(trainer=scaled, select="init-loss-off-chance", use_config=False).findings
    assert finding.evidence["cause"] == "trainer-loss" and finding.evidence["ratio"] == pytest.approx(
        10, rel=0.05
    )
    assert "compute_loss" in finding.fix
    plain = Trainer(model=model, args=args(tmp_path), train_dataset=token_rows(tok), data_collator=collator)
    assert preflight(trainer=plain, select="init-loss-off-chance", use_config=False).findings == []


def clipping_trainer(tmp_path, model, tok, **kwargs):
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    return Trainer(
        model=model, args=args(tmp_path, **kwargs), train_dataset=token_rows(tok), data_collator=collator
    )


@pytest.mark.planted("clipping-off-half-precision")
@pytest.mark.parametrize("precision", ["bf16", "bf16-weights"])
@pytest.mark.parametrize("clip", [0.0, None])
def test_clipping_off_in_half_precision(tmp_path, model_tok, precision, clip):
    """bf16 mixed precision (it runs on the CPU) or a model held in bfloat16, with max_grad_norm 0 or None:
    Trainer does not clip. Its twin with Trainer's default clipping is silent: the detector read the same
    trainer."""
    model, tok = model_tok
    kwargs = {"bf16": True} if precision == "bf16" else {}
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    (finding,) = preflight(
        trainer=clipping_trainer(tmp_path, model, tok, max_grad_norm=clip, **kwargs),
        select="clipping-off-half-precision",
        use_config=False,
    ).findings
    assert finding.severity == "warning" and finding.evidence["max_grad_norm"] == clip
    expected = {"mixed_precision": "bf16"} if precision == "bf16" else {"trainable_dtype": "bfloat16"}
    assert expected.items() <= finding.evidence.items()
    assert "max_grad_norm=1.0" in finding.fix
    clipped = clipping_trainer(tmp_path, model, tok, **kwargs)
    assert clipped.args.max_grad_norm == 1.0
    assert preflight(trainer=clipped, select="clipping-off-half-precision", use_config=False).findings == []


@pytest.mark.clean("clipping-off-half-precision")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clipping_off_in_float32_is_not_flagged(tmp_path, model_tok, seed):
    """Clipping off in float32 is a choice, not a half-precision hazard; a bf16 run with clipping on is the
    default. A whole preflight of each is silent on it, at several seeds."""
    model, tok = model_tok
    for kwargs in ({"max_grad_norm": 0.0}, {"bf16": True}):
        report = preflight(
            trainer=clipping_trainer(tmp_path, model, tok, seed=seed, **kwargs), use_config=False
        )
        assert report.by_rule("clipping-off-half-precision") == [], kwargs
