"""Mask rules: which tokens carry loss. Planted bugs trigger; correct pipelines are silent."""

import pytest

from helpers import run, slugs
from hf_sanity.testing import as_prompt_completion, build_tokenizer
from hf_sanity.tokenview import IGNORE_INDEX

MASK_RULES = ["missing-chat-template", "prompt-in-loss", "empty-loss-mask", "completion-masked",
              "labels-misaligned", "eos-not-learned", "pad-token-missing"]  # fmt: skip


def correct_token_rows(tok, conversations):
    """Pre-tokenized rows with correct completion-only labels, built from the template's own masks."""
    gen = build_tokenizer("generation", "distinct")
    rows = []
    for row in conversations:
        out = gen.apply_chat_template(row["messages"], return_assistant_tokens_mask=True)
        labels = [i if m else IGNORE_INDEX for i, m in zip(out["input_ids"], out["assistant_masks"])]
        rows.append({"input_ids": out["input_ids"], "labels": labels})
    return rows


@pytest.mark.parametrize("fmt", ["messages", "prompt-completion", "conversational", "tokens"])
@pytest.mark.clean(
    "missing-chat-template",
    "prompt-in-loss",
    "empty-loss-mask",
    "completion-masked",
    "labels-misaligned",
    "eos-not-learned",
    "pad-token-missing",
)
def test_correct_pipelines_are_silent(chatml, conversations, fmt):
    rows = {
        "messages": conversations,
        "prompt-completion": as_prompt_completion(conversations),
        "conversational": as_prompt_completion(conversations, conversational=True),
        "tokens": correct_token_rows(chatml, conversations),
    }[fmt]
    assert run(chatml, rows, select=MASK_RULES).findings == []


@pytest.mark.planted("missing-chat-template")
def test_missing_chat_template(conversations):
    report = run(build_tokenizer("base"), conversations[:8], select=MASK_RULES + ["bad-input-values"])
    assert slugs(report) == {"missing-chat-template"}
    assert report.findings[0].evidence["rows"] == 8


@pytest.mark.planted("prompt-in-loss")
def test_prompt_in_loss_when_training_on_all_tokens(chatml, conversations):
    report = run(chatml, conversations, select="prompt-in-loss", loss_on="all")
    (finding,) = report.findings
    assert finding.severity == "warning"
    assert 0.5 < finding.evidence["fraction"] < 0.95
    assert finding.example is not None and finding.example.focus == 0
    assert f"of {finding.evidence['supervised_tokens']:,})" in finding.message


def test_prompt_in_loss_in_prerendered_text(chatml, conversations):
    # A text dataset rendered with the tokenizer's own template: language modelling trains on the prompt too.
    rows = [{"text": chatml.apply_chat_template(r["messages"], tokenize=False)} for r in conversations]
    assert "prompt-in-loss" in slugs(run(chatml, rows, select="prompt-in-loss"))


@pytest.mark.planted("empty-loss-mask")
def test_empty_loss_mask(chatml, conversations):
    rows = correct_token_rows(chatml, conversations[:10])
    rows[3] = {**rows[3], "labels": [IGNORE_INDEX] * len(rows[3]["labels"])}
    (finding,) = run(chatml, rows, select="empty-loss-mask").findings
    assert finding.evidence["rows"] == [3] and finding.evidence["cut_by_max_len"] == 0


def test_empty_loss_mask_after_truncation(chatml, conversations):
    report = run(chatml, conversations[:10], select="empty-loss-mask", max_len=12)
    (finding,) = report.findings
    assert finding.evidence["cut_by_max_len"] == finding.evidence["count"] == 10
    assert "max_len=12" in finding.message


@pytest.mark.planted("completion-masked")
def test_completion_masked_off_by_some(chatml, conversations):
    rows = correct_token_rows(chatml, conversations)
    for row in rows:  # a response template matched three tokens too late
        first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        row["labels"][first : first + 3] = [IGNORE_INDEX] * 3
    (finding,) = run(chatml, rows, select="completion-masked").findings
    assert finding.severity == "error" and finding.evidence["fraction"] > 0.2
    assert (
        finding.example.cells[[c.pos for c in finding.example.cells].index(finding.example.focus)].loss
        is False
    )


def test_completion_masked_when_loss_is_on_the_prompt_only(chatml, conversations):
    rows = []
    for row in correct_token_rows(chatml, conversations):
        inverted = [
            IGNORE_INDEX if label != IGNORE_INDEX else i for i, label in zip(row["input_ids"], row["labels"])
        ]
        rows.append({"input_ids": row["input_ids"], "labels": inverted})
    report = run(chatml, rows, select=["completion-masked", "prompt-in-loss"])
    assert {"completion-masked", "prompt-in-loss"} <= slugs(report)


@pytest.mark.planted("labels-misaligned")
def test_labels_misaligned(chatml, conversations):
    rows = [{"input_ids": r["input_ids"], "labels": r["input_ids"][1:] + [IGNORE_INDEX]}
            for r in correct_token_rows(chatml, conversations)]  # fmt: skip
    (finding,) = run(chatml, rows, select="labels-misaligned").findings
    assert finding.evidence["equal_next"] > 10 * finding.evidence["equal_same"]


@pytest.mark.planted("eos-not-learned")
def test_eos_masked_by_pad_equal_eos_collator(conversations):
    tok = build_tokenizer("chatml", "eos")
    rows = []
    for row in conversations:  # what DataCollatorForLanguageModeling does when pad == EOS
        ids = tok.apply_chat_template(row["messages"])["input_ids"]
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX if i == tok.pad_token_id else i for i in ids]})
    (finding,) = run(tok, rows, select="eos-not-learned").findings
    assert finding.evidence["pad_is_eos"] is True and finding.evidence["cause"] == "pad-is-eos"
    assert finding.evidence["end_tokens_without_loss"] == sum(
        sum(m["role"] == "assistant" for m in r["messages"]) for r in conversations
    )
    assert finding.example.cells[finding.example.focus - finding.example.cells[0].pos].text == "<|im_end|>"


@pytest.mark.planted("eos-not-learned")
def test_a_collator_that_keeps_one_label_per_answer_is_named_not_a_pad_token(chatml, conversations):
    """pad is not EOS here: the end of turn carries no loss because the labels keep one token of each row. The fix
    used to be the pad == EOS one (set a pad token distinct from EOS) although pad_is_eos was false."""
    assert chatml.pad_token_id != chatml.eos_token_id
    rows = []
    for row in correct_token_rows(chatml, conversations):
        first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        rows.append({"input_ids": row["input_ids"],
                     "labels": [label if i == first else IGNORE_INDEX for i, label in enumerate(row["labels"])]})  # fmt: skip
    (finding,) = run(chatml, rows, select="eos-not-learned").findings
    assert finding.evidence["pad_is_eos"] is False and finding.evidence["cause"] == "completion-masked"
    assert finding.evidence["completion_tokens_masked"] >= 0.5 * finding.evidence["completion_tokens"] > 0
    assert "pad_token =" not in finding.fix and "distinct from EOS" not in finding.fix
    assert finding.fix.startswith("The labels mask the answers themselves, not padding")
    assert "the labels mask the answers, not padding" in finding.message


def test_an_end_token_masked_while_pad_is_not_eos_says_so(chatml, conversations):
    rows = []
    for row in correct_token_rows(chatml, conversations):
        labels = list(row["labels"])
        for i, token in enumerate(row["input_ids"]):
            if token == chatml.convert_tokens_to_ids("<|im_end|>") and labels[i] != IGNORE_INDEX:
                labels[i] = IGNORE_INDEX  # a span mask one token short
        rows.append({"input_ids": row["input_ids"], "labels": labels})
    (finding,) = run(chatml, rows, select="eos-not-learned").findings
    assert (finding.evidence["cause"], finding.evidence["pad_is_eos"]) == ("end-masked", False)
    assert "one token short" in finding.fix and "pad_token =" not in finding.fix


def test_eos_missing_at_the_end_of_pretokenized_text():
    tok = build_tokenizer("base", "distinct")
    rows = [{"input_ids": tok(f"The sum of {i} and {i} is {2 * i}.")["input_ids"]} for i in range(10)]
    (finding,) = run(tok, rows, select="eos-not-learned").findings
    assert finding.evidence["completions_without_end"] == 10 and finding.evidence["cause"] == "no-end-token"
    assert finding.fix.startswith("Append the end-of-turn/EOS token")
    with_eos = [{"input_ids": r["input_ids"] + [tok.eos_token_id]} for r in rows]
    assert run(tok, with_eos, select="eos-not-learned").findings == []


@pytest.mark.planted("pad-token-missing")
def test_pad_token_missing(conversations):
    report = run(build_tokenizer("chatml", "none"), conversations[:4], select=MASK_RULES)
    assert slugs(report) == {"pad-token-missing"}
    assert report.findings[0].severity == "warning"  # SFTTrainer sets one itself: not an error on its own


def test_pad_token_fix_names_this_tokenizers_tokens():
    from conftest import real_tokenizer

    llama2 = real_tokenizer("llama2-chat")  # no pad token, but <unk>
    rows = [
        {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]}
    ]
    (finding,) = run(llama2, rows, select="pad-token-missing").findings
    assert finding.evidence["pad_candidate"] == "<unk>" and "'<unk>'" in finding.fix
    assert "<|finetune_right_pad_id|>" not in finding.fix  # no other family's token


@pytest.mark.planted("eos-not-learned")
def test_a_trainers_collator_that_masks_all_but_one_label_gets_the_fix_of_that_cause(tmp_path):
    """The held-out case on a Trainer's own batches: a collator that masks every label but the first supervised
    one of each row, with a pad token that is not EOS. The fix named the pad token; the cause is the collator."""
    import torch
    from dist import tinytrain as tt
    from transformers import DataCollatorForSeq2Seq

    from hf_sanity import preflight

    model, tok = tt.setup()
    assert tok.pad_token_id != tok.eos_token_id
    base = DataCollatorForSeq2Seq(tok)

    def keep_one_label(features):
        batch = base(features)
        labels = batch["labels"]
        first = (labels != IGNORE_INDEX).int().argmax(dim=1)
        kept = labels.gather(1, first[:, None])
        batch["labels"] = torch.full_like(labels, IGNORE_INDEX).scatter(1, first[:, None], kept)
        return batch

    trainer = tt.trainer(tmp_path, model=model, tok=tok, collator=keep_one_label)
    report = preflight(trainer=trainer, select="eos-not-learned", use_config=False)
    (finding,) = report.findings
    assert finding.evidence["pad_is_eos"] is False and finding.evidence["cause"] == "completion-masked"
    assert "pad_token =" not in finding.fix and "mask the answers themselves" in finding.fix
    assert (
        finding.remedy.title
        == "build labels that cover each whole completion and its end-of-turn token in your collator"
    )
