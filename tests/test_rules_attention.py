"""Attention-mask rules on the batches a real Trainer builds: preflight(trainer=...) and the callback."""

import copy

import datasets
import pytest
import torch
from transformers import DataCollatorForLanguageModeling, Trainer

from conftest import real_tokenizer
from helpers import token_rows, trainer_args
from hf_sanity.callback import SanityCallback
from hf_sanity.drivers.preflight import preflight
from hf_sanity.testing import as_prompt_completion, demo_conversations, tiny_model_for, tiny_setup

ATTENTION_RULES = ["padding-attended", "tokens-masked-out", "left-padding-shifts-positions"]


class Remasked:
    """A collator whose attention_mask is rebuilt by ``rule`` (the bugs people write by hand)."""

    def __init__(self, inner, rule):
        self.inner, self.rule = inner, rule

    def __call__(self, examples):
        batch = self.inner(examples)
        batch["attention_mask"] = self.rule(batch)
        return batch


def lm_collator(tok, side="right"):
    tok = copy.deepcopy(tok)
    tok.padding_side = side
    return DataCollatorForLanguageModeling(tok, mlm=False)


def findings(report, rules=ATTENTION_RULES):
    return {f.rule: f for f in report.findings if f.rule in rules or f.rule == "internal-error"}


@pytest.mark.planted("padding-attended")
def test_a_mask_of_ones_over_left_padding(tmp_path):
    """attention_mask = ones_like(input_ids) on a left-padded batch: every real token attends to the padding
    before it. Caught before training and at the first step of the run."""
    model, tok = tiny_setup("chatml")
    collator = Remasked(lm_collator(tok, "left"), lambda b: torch.ones_like(b["input_ids"]))
    watch = SanityCallback(use_config=False, print_findings=False)
    trainer = Trainer(model=model, args=trainer_args(tmp_path), train_dataset=token_rows(tok), processing_class=tok, data_collator=collator,
                      callbacks=[watch])  # fmt: skip
    found = findings(preflight(trainer=trainer, use_config=False))
    assert set(found) == {"padding-attended"}
    assert found["padding-attended"].evidence["positions"] > 0 and found["padding-attended"].evidence["rows"]
    trainer.train()
    during = findings(watch.report)
    assert set(during) == {"padding-attended"} and during["padding-attended"].step == 1


def test_a_mask_of_ones_over_right_padding_without_loss_is_harmless(tmp_path):
    """A causal model never looks ahead: right padding it attends to but does not train on changes nothing."""
    model, tok = tiny_setup("chatml")
    collator = Remasked(lm_collator(tok), lambda b: torch.ones_like(b["input_ids"]))
    trainer = Trainer(
        model=model,
        args=trainer_args(tmp_path),
        train_dataset=token_rows(tok),
        processing_class=tok,
        data_collator=collator,
    )
    assert findings(preflight(trainer=trainer, use_config=False)) == {}


@pytest.mark.planted("tokens-masked-out")
def test_a_mask_built_from_token_ids_when_pad_is_eos(tmp_path):
    """attention_mask = input_ids != pad_id with pad == <|im_end|>: every turn's end is hidden from attention,
    inside the conversation."""
    model, tok = tiny_setup("chatml", "eos")
    pad = tok.pad_token_id
    collator = Remasked(lm_collator(tok), lambda b: (b["input_ids"] != pad).long())
    trainer = Trainer(
        model=model,
        args=trainer_args(tmp_path),
        train_dataset=token_rows(tok),
        processing_class=tok,
        data_collator=collator,
    )
    found = findings(preflight(trainer=trainer, use_config=False))
    assert "tokens-masked-out" in found and "internal-error" not in found
    assert found["tokens-masked-out"].evidence["positions"] >= 4  # one end-of-turn per conversation, at least
    assert found["tokens-masked-out"].evidence["cause"] == "content-hidden"


def supervised_rows(tok, n=16):
    """Conversations as {input_ids, labels} (loss on the assistant turns), unpadded."""
    from hf_sanity.testing.trained import supervised_labels

    rows = [supervised_labels(tok, r["messages"]) for r in demo_conversations(n)]
    return datasets.Dataset.from_list([{"input_ids": ids, "labels": labels} for ids, labels in rows])


def pad_labels_with_pad_id(tok):
    """A hand-written collator: input_ids right-padded with the pad id and attention_mask 0 there (right), and
    the labels padded with the pad id too (the bug: -100 was meant)."""

    def collate(examples):
        width = max(len(e["input_ids"]) for e in examples)
        pad = tok.pad_token_id

        def padded(key, value):
            return torch.tensor([e[key] + [value] * (width - len(e[key])) for e in examples])

        mask = torch.tensor(
            [[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"])) for e in examples]
        )
        return {
            "input_ids": padded("input_ids", pad),
            "labels": padded("labels", pad),
            "attention_mask": mask,
        }

    return collate


@pytest.mark.planted("tokens-masked-out")
@pytest.mark.parametrize("name", ["smollm2-instruct", "qwen2.5-instruct"])
def test_labels_padded_with_the_pad_id_are_the_labels_fault_not_the_masks(tmp_path, name):
    """The collator pads the labels with the pad id instead of -100: the attention mask is right, the padding
    carries loss. Named as such before training and at the first step, and the fix is about the labels."""
    tok = real_tokenizer(name)
    model = tiny_model_for(tok)
    watch = SanityCallback(use_config=False, print_findings=False, select=ATTENTION_RULES)
    trainer = Trainer(model=model, args=trainer_args(tmp_path, remove_unused_columns=False), train_dataset=supervised_rows(tok),
                      data_collator=pad_labels_with_pad_id(tok), processing_class=tok, callbacks=[watch])  # fmt: skip
    before = findings(preflight(trainer=trainer, use_config=False))
    trainer.train()
    for found in (before, findings(watch.report)):
        assert set(found) == {"tokens-masked-out"}
        finding = found["tokens-masked-out"]
        assert finding.evidence["cause"] == "labels-padded"
        assert finding.evidence["padding_labels"] == {str(tok.pad_token_id): finding.evidence["positions"]}
        assert "-100" in finding.fix and "label_pad_token_id" in finding.fix
        assert "Build attention_mask" not in finding.fix


@pytest.mark.planted("left-padding-shifts-positions")
def test_left_padding_with_absolute_position_embeddings(tmp_path):
    """GPT-2's learned positions count the padding: a left-padded example is trained at the wrong positions.
    Measured: its loss differs batched and alone."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = tiny_setup("chatml")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    gpt2 = GPT2LMHeadModel(config)
    trainer = Trainer(model=gpt2, args=trainer_args(tmp_path), train_dataset=token_rows(tok), processing_class=tok,
                      data_collator=lm_collator(tok, "left"))  # fmt: skip
    found = findings(preflight(trainer=trainer, use_config=False))
    assert set(found) == {"left-padding-shifts-positions"}
    evidence = found["left-padding-shifts-positions"].evidence
    assert evidence["pads"] > 0 and evidence["relative_difference"] > 1e-3
    trainer.data_collator = lm_collator(tok, "right")
    assert findings(preflight(trainer=trainer, use_config=False)) == {}


@pytest.mark.clean("padding-attended", "tokens-masked-out", "left-padding-shifts-positions")
def test_a_rotary_model_padded_on_the_left_is_silent(tmp_path):
    """Rotary embeddings are relative: left padding shifts nothing a Llama-style model computes."""
    rotary_padded_on(tmp_path, "left")


@pytest.mark.clean("padding-attended", "tokens-masked-out")  # right padding: no position to shift
def test_a_rotary_model_padded_on_the_right_is_silent(tmp_path):
    rotary_padded_on(tmp_path, "right")


def rotary_padded_on(tmp_path, side):
    model, tok = tiny_setup("chatml")
    trainer = Trainer(model=model, args=trainer_args(tmp_path), train_dataset=token_rows(tok), processing_class=tok,
                      data_collator=lm_collator(tok, side))  # fmt: skip
    report = preflight(trainer=trainer, use_config=False)
    assert findings(report) == {}
    watch = SanityCallback(use_config=False, print_findings=False, select=ATTENTION_RULES)
    trainer.add_callback(watch)
    trainer.train()
    assert findings(watch.report) == {}


@pytest.mark.planted("packing-contamination")
def test_packed_batches_that_carry_an_attention_mask(tmp_path):
    """TRL's padding-free packing isolates examples by position_ids; a collator that adds a 2-D attention mask
    turns that off: the cause is named, and the fix is to drop the mask, not to change attention backend."""
    from trl import SFTConfig, SFTTrainer

    model, tok = tiny_setup("chatml", "eos")
    rows = as_prompt_completion(demo_conversations(24), conversational=True)
    config = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                       use_cpu=True, save_strategy="no", max_length=128, packing=True)  # fmt: skip
    trainer = SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tok)  # fmt: skip
    assert preflight(trainer=trainer, select="packing-contamination", use_config=False).findings == []
    trainer.data_collator = Remasked(trainer.data_collator, lambda b: torch.ones_like(b["input_ids"]))
    (finding,) = preflight(trainer=trainer, select="packing-contamination", use_config=False).findings
    assert finding.evidence["cause"] == "attention-mask-with-packing" and "attention_mask" in finding.fix
