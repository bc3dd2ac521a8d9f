"""`future-token-leak`: the causal mask, checked by what the model computes, through the entry points a user
runs (preflight with objects, with trainer=, the CLI, SanityCallback's first batch, diagnose's layer 3)."""

import copy
import json

import datasets
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertLMHeadModel,
    DataCollatorForLanguageModeling,
    Trainer,
)
from transformers.modeling_outputs import CausalLMOutput

from conftest import real_tokenizer
from helpers import cli, token_rows, trainer_args
from hf_sanity.callback import SanityCallback
from hf_sanity.drivers.preflight import preflight
from hf_sanity.measure import causal
from hf_sanity.testing import TinyConfig, demo_conversations, tiny_model_for, tiny_setup

RULE = "future-token-leak"


def lm_collator(tok, side="right"):
    tok = copy.deepcopy(tok)
    tok.padding_side = side
    return DataCollatorForLanguageModeling(tok, mlm=False)


class FourDimMask:
    """A collator that builds its own 4-D attention mask (batch, 1, query, key), True = attend: ``causal``
    lower-triangular (and block-diagonal across packed sequences, by their position ids), or not."""

    def __init__(self, inner, *, causal: bool):
        self.inner, self.causal = inner, causal

    def __call__(self, examples):
        batch = self.inner(examples)
        ids = batch["input_ids"]
        rows, width = ids.shape
        keys = (
            batch["attention_mask"].bool()
            if "attention_mask" in batch
            else torch.ones_like(ids, dtype=torch.bool)
        )
        mask = keys[:, None, None, :].expand(rows, 1, width, width)
        if self.causal:
            mask = mask & torch.tril(torch.ones(width, width, dtype=torch.bool))
            if "position_ids" in batch:  # packed: each sequence sees only itself
                sequence = torch.cumsum(batch["position_ids"] == 0, dim=1)
                mask = mask & (sequence[:, None, :, None] == sequence[:, None, None, :])
        batch["attention_mask"] = mask.contiguous()
        return batch


def leak(report):
    found = [f for f in report.findings if f.rule in (RULE, "internal-error")]
    return found[0] if found else None


@pytest.fixture
def measured(monkeypatch):
    """Every measurement the rule reads: a clean result must come from a check that ran."""
    seen = []
    real = causal.future_token_leak

    def spy(model, batch, **kwargs):
        result = real(model, batch, **kwargs)
        seen.append(result)
        return result

    monkeypatch.setattr(causal, "future_token_leak", spy)
    return seen


def ran_and_unmoved(seen):
    assert seen and all(m is not None and m["rows"] for m in seen)
    return max(max(row["moved"]) for m in seen for row in m["rows"]) == 0.0


def bert(tok, *, is_decoder: bool, seed: int = 0):
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, is_decoder=is_decoder, pad_token_id=tok.pad_token_id)  # fmt: skip
    return BertLMHeadModel(config)


class TinyEncoderLM(nn.Module):
    """A hand-written LM over nn.TransformerEncoder: with ``causal`` it passes the square subsequent mask (as it
    must), without it every position attends to the whole row (the bug)."""

    def __init__(self, vocab: int, *, causal: bool, width: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.causal = causal
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        width = input_ids.shape[1]
        mask = torch.ones(width, width, dtype=torch.bool).triu(1) if self.causal else None
        padding = attention_mask == 0 if attention_mask is not None else None
        hidden = self.encoder(
            self.embed(input_ids), mask=mask, src_key_padding_mask=padding, is_causal=self.causal
        )
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


# -- planted ---------------------------------------------------------------------------------------
@pytest.mark.planted("future-token-leak")
def test_a_collator_that_builds_a_bidirectional_4d_mask(tmp_path):
    """The collator's own (batch, 1, T, T) mask marks padding only: every token sees the whole row. Named before
    training with its cause (the mask, not the model), and at the first step of the run."""
    model, tok = tiny_setup("chatml")
    watch = SanityCallback(use_config=False, print_findings=False)
    trainer = Trainer(model=model, args=trainer_args(tmp_path), train_dataset=token_rows(tok), processing_class=tok,
                      data_collator=FourDimMask(lm_collator(tok), causal=False), callbacks=[watch])  # fmt: skip
    found = leak(preflight(trainer=trainer, select=RULE, use_config=False))
    assert found is not None and found.rule == RULE and found.severity == "error"
    assert found.evidence["cause"] == "attention-mask" and found.evidence["mask_dims"] == 4
    assert found.evidence["relative_difference"] > 0.01 and found.evidence["rows"]
    assert "tril" in found.fix and found.example is not None and found.example.focus is not None
    trainer.train()
    during = [f for f in watch.report.findings if f.rule in (RULE, "internal-error")]
    assert [(f.rule, f.step, f.evidence["cause"]) for f in during] == [(RULE, 1, "attention-mask")]


@pytest.mark.planted("future-token-leak")
@pytest.mark.parametrize("seed", [0, 1])
def test_an_encoder_used_as_a_decoder(seed):
    """BertLMHeadModel without is_decoder=True attends both ways (transformers only logs a warning): even at a
    random init its logits before t move with the tokens after t."""
    _, tok = tiny_setup("chatml")
    report = preflight(model=bert(tok, is_decoder=False, seed=seed), tokenizer=tok, dataset=demo_conversations(16),
                       select=RULE, use_config=False)  # fmt: skip
    found = leak(report)
    assert found is not None and found.rule == RULE
    assert found.evidence["cause"] == "model" and found.evidence["model"] == "BertLMHeadModel"
    assert "is_decoder=False" in found.message and "is_decoder=True" in found.fix
    assert found.evidence["relative_difference"] > 10 * found.evidence["tolerance"]


@pytest.mark.planted("future-token-leak")
def test_a_custom_module_without_a_causal_mask(tmp_path):
    """A hand-written nn.Module trained by Trainer: its encoder gets no causal mask."""
    _, tok = tiny_setup("chatml")
    model = TinyEncoderLM(len(tok), causal=False)
    trainer = Trainer(model=model, args=trainer_args(tmp_path), train_dataset=token_rows(tok), processing_class=tok,
                      data_collator=lm_collator(tok))  # fmt: skip
    found = leak(preflight(trainer=trainer, select=RULE, use_config=False))
    assert found is not None and found.rule == RULE
    assert found.evidence["cause"] == "model" and found.evidence["model"] == "TinyEncoderLM"
    assert found.evidence["mask_dims"] == 2


@pytest.mark.slow
@pytest.mark.planted("future-token-leak")
def test_cli_names_an_encoder_saved_as_a_causal_lm(tmp_path):
    _, tok = tiny_setup("chatml")
    folder = tmp_path / "model"
    bert(tok, is_decoder=False).save_pretrained(folder)
    tok.save_pretrained(folder)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo_conversations(16)))
    out = tmp_path / "report.json"
    result = cli("preflight", "--model", folder, "--dataset", data, "--select", RULE, "--json", out)
    assert result.returncode == 1, result.stderr
    [finding] = json.loads(out.read_text())["findings"]
    assert finding["rule"] == RULE and finding["evidence"]["cause"] == "model"


@pytest.mark.slow
@pytest.mark.planted("future-token-leak")
def test_diagnose_stops_at_shapes_and_masks(tmp_path):
    """The overfit passes (the model reads the answers), the step-0 loss is at chance: the leak is layer 3's."""
    from hf_sanity.protocol import diagnose

    model, tok = tiny_setup("chatml")
    trainer = Trainer(model=model, args=trainer_args(tmp_path, learning_rate=1e-2), train_dataset=token_rows(tok),
                      processing_class=tok, data_collator=FourDimMask(lm_collator(tok), causal=False))  # fmt: skip
    report = diagnose(trainer=trainer, write_repro=False, lr=1e-2, steps=100)
    assert report.stats["broken_layer"].startswith("3.") and report.stats["overfit"]["passed"]
    [found] = report.by_rule(RULE)
    assert found.evidence["cause"] == "attention-mask"
    [item] = [i for i in report.stats["checklist"] if "causal mask" in i["item"]]
    assert item["status"] == "failed"


# -- clean -----------------------------------------------------------------------------------------
@pytest.mark.clean("future-token-leak")
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_causal_models_are_silent(seed, attention, measured):
    _, tok = tiny_setup("chatml")
    model = tiny_model_for(tok, TinyConfig(seed=seed))
    model.config._attn_implementation = attention
    report = preflight(
        model=model, tokenizer=tok, dataset=demo_conversations(16), select=RULE, use_config=False
    )
    assert leak(report) is None
    assert ran_and_unmoved(measured)


@pytest.mark.clean("future-token-leak")
def test_an_encoder_configured_as_a_decoder_is_silent(measured):
    _, tok = tiny_setup("chatml")
    report = preflight(model=bert(tok, is_decoder=True), tokenizer=tok, dataset=demo_conversations(16), select=RULE,
                       use_config=False)  # fmt: skip
    assert leak(report) is None and ran_and_unmoved(measured)


@pytest.mark.clean("future-token-leak")
def test_a_custom_module_with_its_causal_mask_is_silent(tmp_path, measured):
    _, tok = tiny_setup("chatml")
    trainer = Trainer(model=TinyEncoderLM(len(tok), causal=True), args=trainer_args(tmp_path), train_dataset=token_rows(tok),
                      processing_class=tok, data_collator=lm_collator(tok))  # fmt: skip
    assert leak(preflight(trainer=trainer, select=RULE, use_config=False)) is None
    assert ran_and_unmoved(measured)


@pytest.mark.clean("future-token-leak")
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("four_dim", [False, True])
def test_padded_batches_with_causal_masks_are_silent(tmp_path, side, four_dim, measured):
    model, tok = tiny_setup("chatml")
    collator = lm_collator(tok, side)
    if four_dim:
        collator = FourDimMask(collator, causal=True)
    trainer = Trainer(model=model, args=trainer_args(tmp_path), train_dataset=token_rows(tok), processing_class=tok,
                      data_collator=collator)  # fmt: skip
    assert leak(preflight(trainer=trainer, select=RULE, use_config=False)) is None
    assert ran_and_unmoved(measured)


@pytest.mark.clean("future-token-leak")
@pytest.mark.parametrize("mask", ["position-ids", "block-diagonal-4d"])
def test_packed_batches_with_correct_masks_are_silent(tmp_path, mask, measured):
    """TRL's padding-free packing (position ids restart per example), and the same rows with a block-diagonal
    causal 4-D mask: several sequences in a row, none of them seeing ahead."""
    from trl import SFTConfig, SFTTrainer

    from hf_sanity.testing import as_prompt_completion

    model, tok = tiny_setup("chatml")
    rows = as_prompt_completion(demo_conversations(24), conversational=True)
    config = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                       use_cpu=True, save_strategy="no", max_length=128, packing=True)  # fmt: skip
    trainer = SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tok)  # fmt: skip
    if mask == "block-diagonal-4d":
        trainer.data_collator = FourDimMask(trainer.data_collator, causal=True)
    batch = next(iter(trainer.get_train_dataloader()))
    assert (batch["position_ids"][:, 1:] == 0).any()  # packed: sequences restart inside a row
    assert leak(preflight(trainer=trainer, select=RULE, use_config=False)) is None
    assert ran_and_unmoved(measured)


@pytest.mark.clean("future-token-leak")
def test_a_clean_run_with_the_callback_is_silent_and_unchanged(tmp_path, measured):
    """The first batch's leak check runs inside the first step and leaves the run bit-for-bit the same."""
    model, tok = tiny_setup("chatml")
    watched = copy.deepcopy(model)
    losses = []
    for m, callbacks in (
        (model, []),
        (watched, [SanityCallback(use_config=False, print_findings=False, select=RULE)]),
    ):
        trainer = Trainer(model=m, args=trainer_args(tmp_path, max_steps=3, logging_steps=1), train_dataset=token_rows(tok),
                          processing_class=tok, data_collator=lm_collator(tok), callbacks=callbacks)  # fmt: skip
        trainer.train()
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
        if callbacks:
            assert callbacks[0].report.findings == []
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), watched.state_dict().values()))
    assert ran_and_unmoved(measured)


# -- a real vocabulary: the logits compared on a subset of the head's rows ---------------------------------
def test_the_compared_logits_are_the_full_logits_on_a_subset_of_the_vocabulary():
    """Above 2 x HEAD_ROWS tokens the measurement projects the head's input on HEAD_ROWS evenly spread rows: the
    numbers are the model's own logits at those columns, not an approximation."""
    tok = real_tokenizer("qwen2.5-instruct")
    model = tiny_model_for(tok).eval()
    batch = {
        "input_ids": torch.randint(0, len(tok), (2, 12)),
        "attention_mask": torch.ones(2, 12, dtype=torch.long),
    }
    with torch.no_grad():
        full = model(**batch).logits
        subset = causal._logits(model, batch)
    assert full.shape[-1] > 2 * causal.HEAD_ROWS and subset.shape[-1] == causal.HEAD_ROWS
    columns = torch.linspace(0, full.shape[-1] - 1, causal.HEAD_ROWS).round().long()
    torch.testing.assert_close(subset, full[..., columns], rtol=1e-5, atol=1e-5)


@pytest.mark.planted("future-token-leak")
def test_a_bidirectional_mask_over_a_152k_vocabulary(tmp_path):
    """Qwen2.5's real vocabulary: the leak of a 4-D mask that marks padding only is found on the subset of the
    vocabulary, with its cause."""
    tok = real_tokenizer("qwen2.5-instruct")
    model = tiny_model_for(tok)
    trainer = Trainer(model=model, args=trainer_args(tmp_path), train_dataset=token_rows(tok), processing_class=tok,
                      data_collator=FourDimMask(lm_collator(tok), causal=False))  # fmt: skip
    found = leak(preflight(trainer=trainer, select=RULE, use_config=False))
    assert found is not None and found.rule == RULE and found.evidence["cause"] == "attention-mask"
    assert found.evidence["relative_difference"] > 10 * found.evidence["tolerance"]


@pytest.mark.clean("future-token-leak")
@pytest.mark.parametrize("four_dim", [False, True])
def test_a_causal_model_over_a_152k_vocabulary_is_silent(tmp_path, four_dim, measured):
    tok = real_tokenizer("qwen2.5-instruct")
    collator = FourDimMask(lm_collator(tok), causal=True) if four_dim else lm_collator(tok)
    trainer = Trainer(model=tiny_model_for(tok), args=trainer_args(tmp_path), train_dataset=token_rows(tok),
                      processing_class=tok, data_collator=collator)  # fmt: skip
    assert leak(preflight(trainer=trainer, select=RULE, use_config=False)) is None
    assert ran_and_unmoved(measured)
