"""hf_sanity.testing: every tiny variant builds offline, deterministically, and trains."""

import time

import pytest

from hf_sanity.testing import TEMPLATES, build_tokenizer, demo_conversations, tiny_model_dir, tiny_setup

MESSAGES = [
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "2 plus 2 is 4."},
]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("pad", ["distinct", "eos", "none"])
def test_every_variant_builds(template, pad):
    tok = build_tokenizer(template, pad)
    assert len(tok) == 1000
    if pad == "eos":
        assert tok.pad_token == tok.eos_token
    elif pad == "distinct":
        assert tok.pad_token is not None and tok.pad_token != tok.eos_token
    else:
        assert tok.pad_token is None
    assert (tok.chat_template is None) == (template == "base")
    assert (
        tok.decode(tok("Paris is the capital.", add_special_tokens=False)["input_ids"])
        == "Paris is the capital."
    )


def test_templates_render_their_family():
    assert build_tokenizer("chatml").apply_chat_template(MESSAGES, tokenize=False) == (
        "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n2 plus 2 is 4.<|im_end|>\n"
    )
    llama = build_tokenizer("llama3")
    assert llama.apply_chat_template(MESSAGES, tokenize=False).startswith(
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    )
    # Like Llama-3: rendered text tokenized again gets a second BOS.
    text = llama.apply_chat_template(MESSAGES, tokenize=False)
    assert llama(text)["input_ids"][:2] == [llama.bos_token_id] * 2


def test_generation_template_marks_assistant_tokens():
    tok = build_tokenizer("generation")
    out = tok.apply_chat_template(MESSAGES, return_assistant_tokens_mask=True)
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(marked) == "2 plus 2 is 4.<|im_end|>"


def test_tokenizer_is_deterministic():
    from hf_sanity.testing.factory import _bpe_json

    first = _bpe_json()
    _bpe_json.cache_clear()
    assert _bpe_json() == first


def test_model_folder_is_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SANITY_CACHE", str(tmp_path))
    folder = tiny_model_dir("chatml", "eos")
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer_config.json").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    started = time.perf_counter()
    assert tiny_model_dir("chatml", "eos") == folder
    assert time.perf_counter() - started < 1.0
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folders left behind


def test_demo_conversations_are_deterministic_and_unique():
    rows = demo_conversations(64)
    assert rows == demo_conversations(64)
    assert len({repr(r) for r in rows}) == 64
    assert any(len(r["messages"]) > 3 for r in rows) and any(
        r["messages"][0]["role"] == "system" for r in rows
    )


def test_tiny_model_trains_with_trainer(tmp_path):
    import datasets
    import torch
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    model, tok = tiny_setup("chatml", "distinct")
    rows = [
        {"input_ids": tok.apply_chat_template(r["messages"])["input_ids"]} for r in demo_conversations(16)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=8, learning_rate=3e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 1.0
    assert torch.isfinite(torch.tensor(losses)).all()
