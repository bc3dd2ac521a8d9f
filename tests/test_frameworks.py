"""The callback on rows a framework prepared before its collator: LLaMA-Factory's `cutoff_len` (which its trainer
never sees) read off the first batch as truncation in LLaMA-Factory's terms, not as an end-of-turn masking bug;
a framework's chat template that is not the tokenizer's caught at the first step; the trainer and its framework
said in `stats.trainer`.

The rows are built the way LLaMA-Factory 0.9's supervised processor builds them (its `infer_seqlen` splits the
budget between prompt and answer, cutting both); the trainer is a real `Trainer` subclass whose class lives
where LLaMA-Factory's does. tests/test_frameworks_real.py runs LLaMA-Factory itself where its virtualenv is.
"""

from __future__ import annotations

import datasets
import pytest
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_sanity.callback import SanityCallback
from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.testing import demo_conversations, tiny_setup

# Where LLaMA-Factory's SFT trainer class lives: the callback tells a framework by its trainer's module.
LLAMAFACTORY_SFT = "llamafactory.train.sft.trainer"


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LLaMA-Factory 0.9's split of ``cutoff_len`` between the prompt and the answer (data/processor/processor_utils)."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def llamafactory_rows(tok, rows, cutoff_len: int, *, template_tok=None, train_on_prompt=False) -> list[dict]:
    """Single-turn rows as LLaMA-Factory's supervised processor prepares them (`train_on_prompt: false`): the
    prompt rendered with the generation prompt, the answer and its end of turn, each cut by ``infer_seqlen``;
    the prompt's labels masked. ``template_tok``: render with another tokenizer's template (`template:` set to
    another family), tokenized by ``tok``; ``train_on_prompt``: the prompt's labels kept (`train_on_prompt: true`)."""
    render = template_tok or tok
    out = []
    for row in rows:
        messages = row["messages"][:2]
        prompt = render.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        whole = render.apply_chat_template(messages, tokenize=False)
        source = tok.encode(prompt, add_special_tokens=False)
        target = tok.encode(whole[len(prompt) :].rstrip("\n"), add_special_tokens=False)
        source_len, target_len = infer_seqlen(len(source), len(target), cutoff_len)
        source, target = source[:source_len], target[:target_len]
        labels = source if train_on_prompt else [IGNORE_INDEX] * len(source)
        out.append({"input_ids": source + target, "labels": labels + target})
    return out


def llamafactory_trainer(tmp_path, rows, callbacks, tok, model):
    """A `Seq2SeqTrainer` subclass in LLaMA-Factory's module, as LLaMA-Factory's run_sft builds it."""
    trainer_cls = type("CustomSeq2SeqTrainer", (Seq2SeqTrainer,), {"__module__": LLAMAFACTORY_SFT})
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False,
    )  # fmt: skip
    collator = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=IGNORE_INDEX)
    return trainer_cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                       data_collator=collator, processing_class=tok, callbacks=list(callbacks))  # fmt: skip


def run(tmp_path, cutoff_len: int, *, template: str | None = None, train_on_prompt=False):
    model, tok = tiny_setup("chatml")
    template_tok = tiny_setup(template)[1] if template else None
    rows = llamafactory_rows(tok, demo_conversations(16), cutoff_len, template_tok=template_tok,
                             train_on_prompt=train_on_prompt)  # fmt: skip
    watch = SanityCallback(use_config=False, print_findings=False)
    llamafactory_trainer(tmp_path, rows, [watch], tok, model).train()
    return watch.report, rows


@pytest.mark.planted("truncated-completion")
def test_llamafactory_cutoff_len_is_truncation_in_its_own_terms(tmp_path):
    report, rows = run(tmp_path, 12)
    assert {len(r["input_ids"]) for r in rows} == {12}  # the planted bug: every row cut to cutoff_len
    found = {f.rule: f for f in report.findings}
    assert "eos-not-learned" not in found and "pad-token-missing" not in found, [
        f.message for f in report.findings
    ]
    assert "internal-error" not in found
    finding = found["truncated-completion"]
    evidence = finding.evidence
    assert evidence["cause"] == "trainer-max-length" and evidence["cut_read_from"] == "batch"
    assert evidence["framework"] == "LLaMA-Factory" and evidence["setting"] == "cutoff_len"
    assert evidence["max_len"] == 12 and evidence["cut_mid_answer"] >= 2 and finding.severity == "error"
    assert finding.message.startswith("LLaMA-Factory's cutoff_len=12 ")
    assert "`cutoff_len` in the LLaMA-Factory config" in finding.fix
    assert report.stats["trainer"] == {"class": "CustomSeq2SeqTrainer", "module": LLAMAFACTORY_SFT,
                                       "framework": "LLaMA-Factory"}  # fmt: skip


@pytest.mark.clean("truncated-completion", "eos-not-learned", "template-mismatch")
def test_llamafactory_rows_that_fit_their_cutoff_len_are_silent(tmp_path):
    report, rows = run(tmp_path, 1024)
    assert len({len(r["input_ids"]) for r in rows}) > 1
    assert [f.message for f in report.findings if f.severity in ("error", "warning")] == []
    assert report.stats["trainer"]["framework"] == "LLaMA-Factory"


@pytest.mark.planted("template-mismatch")
def test_a_framework_template_that_is_not_the_tokenizers_is_caught_at_the_first_step(tmp_path):
    """LLaMA-Factory's `template: llama3` on a ChatML tokenizer: the rows carry Llama-3's header markers (as
    text pieces), the saved tokenizer renders ChatML at serving time."""
    report, _ = run(tmp_path, 1024, template="llama3")
    (finding,) = report.by_rule("template-mismatch")
    assert finding.severity == "error" and finding.step == 1
    assert finding.evidence["foreign_formats"] == {"llama-3": 4}  # each row of the first batch (4)
    assert finding.evidence["template_formats"] == ["chatml"]
    assert finding.fix.startswith("Set `template:` in the LLaMA-Factory config to the model's own family")


@pytest.mark.planted("prompt-in-loss")
def test_llamafactory_train_on_prompt_is_named_in_its_own_terms(tmp_path):
    report, _ = run(tmp_path, 1024, train_on_prompt=True)
    (finding,) = report.by_rule("prompt-in-loss")
    assert finding.evidence["cause"] == "labels" and finding.evidence["fraction"] > 0.3
    assert "`train_on_prompt: false`" in finding.fix
