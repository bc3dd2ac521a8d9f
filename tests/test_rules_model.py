"""Model rules, on the tiny model: planted bugs trigger, the clean setup is silent."""

import copy
import math

import datasets
import pytest
import torch

from helpers import run
from hf_sanity.testing import build_tokenizer, tiny_setup

MODEL_RULES = ["vocab-size-mismatch", "untrained-special-tokens", "new-tokens-frozen", "init-loss-off-chance",
               "no-trainable-params"]  # fmt: skip


@pytest.fixture
def setup():
    model, tok = tiny_setup("chatml", "distinct")
    return copy.deepcopy(model), tok


@pytest.mark.clean(
    "vocab-size-mismatch",
    "untrained-special-tokens",
    "new-tokens-frozen",
    "init-loss-off-chance",
    "no-trainable-params",
)
def test_clean_model_is_silent(setup, conversations):
    model, tok = setup
    assert run(tok, conversations, model=model, select=MODEL_RULES).findings == []


def test_model_is_loaded_only_when_a_model_rule_runs(conversations):
    _, tok = tiny_setup("chatml", "distinct")
    calls = []

    def loader():
        calls.append(1)
        return tiny_setup("chatml", "distinct")[0]

    run(tok, conversations, model=loader, select="prompt-in-loss")
    assert calls == []
    run(tok, conversations, model=loader, select="init-loss-off-chance")
    assert calls == [1]


@pytest.mark.planted("vocab-size-mismatch")
def test_token_ids_beyond_the_embeddings(setup, conversations):
    model, _ = setup
    tok = build_tokenizer("chatml")
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Call it."},
                {"role": "assistant", "content": "<tool_call> go"},
            ]
        }
    ]
    (finding,) = run(tok, rows + conversations[:3], model=model, select="vocab-size-mismatch").findings
    assert finding.evidence["max_token_id"] == 1000 and finding.evidence["embedding_rows"] == 1000
    assert finding.evidence["rows"] == [0]
    # Unused extra tokens still mean the tokenizer does not belong to the model.
    (finding,) = run(tok, conversations[:3], model=model, select="vocab-size-mismatch").findings
    assert finding.evidence["tokenizer_size"] == 1001


@pytest.mark.planted("untrained-special-tokens")
def test_untrained_special_token_rows(setup, conversations):
    model, tok = setup
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.convert_tokens_to_ids("<|im_end|>")] = 0.0
    (finding,) = run(tok, conversations, model=model, select="untrained-special-tokens").findings
    assert finding.evidence["tokens"] == ["<|im_end|>"]


def test_collapsed_special_token_rows(setup, conversations):
    model, tok = setup
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[tok.convert_tokens_to_ids("<|im_start|>")] = emb[tok.convert_tokens_to_ids("<|im_end|>")]
    (finding,) = run(tok, conversations, model=model, select="untrained-special-tokens").findings
    assert sorted(finding.evidence["collapsed"]) == sorted(
        tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    )


def test_embedding_rows_are_read_in_chunks_and_a_partitioned_embedding_is_not_measured(setup, monkeypatch):
    """Rows compared in chunks find what the whole matrix does; a ZeRO-3 partition (an empty local tensor)
    is not judged at all, rather than judged empty."""
    from hf_sanity.rules import model as rules

    model, tok = setup
    ids = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    with torch.no_grad():
        model.get_input_embeddings().weight[ids[1]] = 0.0
    whole = rules.untrained_rows(model.get_input_embeddings(), ids)
    monkeypatch.setattr(rules, "EMBEDDING_CHUNK", 7)  # 1000 rows in 143 chunks
    assert rules.untrained_rows(model.get_input_embeddings(), ids) == whole == {
        "near_zero": [ids[1]], "near_mean": [], "collapsed": []
    }  # fmt: skip
    partition = torch.nn.Embedding(0, 64)  # what ZeRO-3 leaves on a rank outside a gathered context
    assert rules.untrained_rows(partition, ids) is None


def lora(model, **kwargs):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **kwargs))


@pytest.mark.planted("new-tokens-frozen")
def test_new_tokens_frozen_under_lora(setup):
    model, _ = setup
    tok = build_tokenizer("chatml")
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    model.resize_token_embeddings(len(tok))  # new rows at the mean: untrained
    rows = [{"messages": [{"role": "user", "content": "Call."}, {"role": "assistant", "content": f"<tool_call> {i}"}]}
            for i in range(4)]  # fmt: skip
    frozen = run(tok, rows, model=lora(copy.deepcopy(model)), select="new-tokens-frozen")
    (finding,) = frozen.findings
    assert finding.evidence["tokens"] == ["<tool_call>"]
    trained = run(
        tok, rows, model=lora(model, modules_to_save=["embed_tokens", "lm_head"]), select="new-tokens-frozen"
    )
    assert trained.findings == []


@pytest.mark.planted("init-loss-off-chance")
def test_init_loss_far_above_chance(setup, conversations):
    model, tok = setup
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # a broken init: confident and wrong
    (finding,) = run(tok, conversations, model=model, select="init-loss-off-chance").findings
    assert finding.evidence["direction"] == "above" and finding.severity == "error"
    assert finding.evidence["loss"] > math.log(len(tok)) + 1
    assert finding.evidence["cause"] == "nothing-predicted" and finding.evidence["top1"] < 0.02


def test_init_loss_far_below_chance_when_the_model_has_seen_the_data(setup, conversations):
    model, tok = setup
    rows = conversations[:4]
    ids = [tok.apply_chat_template(r["messages"])["input_ids"] for r in rows]
    width = max(map(len, ids))
    batch = torch.tensor([seq + [tok.pad_token_id] * (width - len(seq)) for seq in ids])
    mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in ids])
    labels = batch.masked_fill(mask == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(150):  # memorise the four examples, all four in each step
        model(input_ids=batch, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    # the loss on the answers (the cause is told by blanking the prompt: it must not carry loss itself)
    (finding,) = run(tok, rows, model=model, select="init-loss-off-chance", loss_on="completion").findings
    assert finding.evidence["direction"] == "below"
    # It answers from the question, but the questions do not contain the answers: it has seen them.
    assert finding.evidence["cause"] == "seen-data" and finding.severity == "warning", finding.message
    assert finding.evidence["loss_prompt_blanked"] > 2 * finding.evidence["loss"]
    assert finding.evidence["answer_in_prompt"] < 0.5 and "trained on these examples" in finding.fix


@pytest.mark.planted("no-trainable-params")
def test_no_trainable_params(setup, conversations):
    model, tok = setup
    model.requires_grad_(False)
    (finding,) = run(tok, conversations[:4], model=model, select="no-trainable-params").findings
    assert finding.evidence["trainable"] == 0


def test_preflight_on_a_saved_dataset_folder(setup, conversations, tmp_path):
    model, tok = setup
    datasets.Dataset.from_list(conversations).save_to_disk(str(tmp_path / "ds"))
    from hf_sanity.measure.sources import load_dataset_ref

    data = load_dataset_ref(str(tmp_path / "ds"))
    assert run(tok, data, model=model, select=MODEL_RULES).findings == []


@pytest.mark.planted("init-loss-above-base")
def test_init_loss_above_base_for_a_model_pretrained_without_the_template(setup, conversations):
    model, tok = setup
    # "Pretraining": the plain-text form of the data, never the chat template.
    texts = ["\n\n".join(m["content"] for m in r["messages"]) for r in conversations]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(30):
        for lo in range(0, len(texts), 16):
            batch = tok(texts[lo : lo + 16], return_tensors="pt", padding=True)
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            model(**batch, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    (finding,) = run(tok, conversations, model=model, select="init-loss-above-base").findings
    assert finding.evidence["templated_loss"] > 1.5 * finding.evidence["plain_loss"], finding.evidence


@pytest.mark.clean("init-loss-above-base")
def test_init_loss_above_base_is_silent_on_a_fresh_model(setup, conversations):
    model, tok = setup
    assert run(tok, conversations, model=model, select="init-loss-above-base").findings == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_side_checks_hold_in_half_precision(setup, conversations, dtype):
    """The model-side checks run on the model as loaded, bf16 as well as fp32: clean stays clean (no
    internal-error), and planted bugs are still found."""
    model, tok = setup
    model = model.to(dtype)
    clean = run(tok, conversations, model=model, select="model")
    assert [f"{f.rule}: {f.message}" for f in clean.findings if f.severity != "info"] == []
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.convert_tokens_to_ids("<|im_end|>")] = 0.0
        model.lm_head.weight.mul_(60.0)
    broken = run(tok, conversations, model=model, select="model")
    assert {f.rule for f in broken.findings} == {"untrained-special-tokens", "init-loss-off-chance"}


@pytest.mark.planted("checks-skipped")
def test_checks_that_need_a_failed_precondition_are_skipped_not_crashed(setup, conversations):
    """Token ids beyond the embedding: the forward pass behind the step-0 loss checks would raise IndexError.
    They are skipped, the report says so once, and nothing is an internal error."""
    model, _ = setup
    tok = build_tokenizer("chatml")
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>"]})
    rows = [{"messages": [{"role": "user", "content": "Call it."}, {"role": "assistant", "content": f"<tool_call> {i}"}]}
            for i in range(4)] + conversations[:8]  # fmt: skip
    report = run(tok, rows, model=model)
    assert "internal-error" not in {f.rule for f in report.findings}
    assert report.by_rule("vocab-size-mismatch")[0].severity == "error"
    (skipped,) = report.by_rule("checks-skipped")
    assert skipped.severity == "info" and skipped.evidence["needs"] == "vocab-size-mismatch"
    assert set(skipped.evidence["skipped"]) == {
        "init-loss-off-chance",
        "init-loss-above-base",
        "input-ignored",
        "future-token-leak",
    }
    # Selected alone, the step-0 check still measures its precondition first (without reporting it).
    alone = run(tok, rows, model=model, select="init-loss-off-chance")
    assert [f.rule for f in alone.findings] == ["checks-skipped"]
