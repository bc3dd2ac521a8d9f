"""The supervised loss measured in chunks at the LM head equals the loss over full logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure import losses
from hf_sanity.measure.tensors import pad_batches
from hf_sanity.testing import demo_conversations, tiny_setup


def full_logits_loss(model, batches) -> tuple[float, float]:
    total, count, entropy = 0.0, 0, 0.0
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            mask = batch["labels"][:, 1:] != IGNORE_INDEX
            log_probs = F.log_softmax(logits[:, :-1][mask].float(), -1)
            total += float(F.nll_loss(log_probs, batch["labels"][:, 1:][mask], reduction="sum"))
            entropy += float(-(log_probs.exp() * log_probs).sum())
            count += int(mask.sum())
    return total / count, entropy / count


@pytest.fixture(scope="module")
def batches():
    model, tok = tiny_setup("chatml", "distinct")
    seqs = []
    for row in demo_conversations(12):
        ids = tok.apply_chat_template(row["messages"])["input_ids"]
        prompt = len(tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True)["input_ids"])
        seqs.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return model, pad_batches(seqs, tok.pad_token_id, 4)


@pytest.mark.parametrize("chunk", [1 << 24, 3000])  # one chunk per batch, and chunks of 3 positions
def test_chunked_loss_equals_the_full_logits_loss(batches, chunk, monkeypatch):
    model, padded = batches
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", chunk)
    measured = losses.token_loss(model, padded, detail=True)
    loss, entropy = full_logits_loss(model, padded)
    assert measured["loss"] == pytest.approx(loss, abs=1e-4)
    assert measured["entropy"] == pytest.approx(entropy, abs=1e-4)


def test_a_final_soft_capping_is_applied_to_the_chunks_too(batches):
    model, padded = batches
    capped = copy.deepcopy(model)
    capped.config.final_logit_softcapping = 2.0  # what the model would do after its head (Gemma 2/3)
    original = capped.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = torch.tanh(out.logits / 2.0) * 2.0
        return out

    capped.forward = forward
    loss, _ = full_logits_loss(capped, padded)
    assert losses.token_loss(capped, padded)["loss"] == pytest.approx(loss, abs=1e-4)


def test_bf16_model_is_scored_with_float32_sums(batches):
    model, padded = batches
    half = copy.deepcopy(model).to(torch.bfloat16)
    measured = losses.token_loss(half, padded)
    reference, _ = full_logits_loss(half, padded)
    assert measured["loss"] == pytest.approx(reference, abs=1e-2)  # bf16 logits, float32 log-softmax


def test_entropy_is_measured_only_when_asked(batches):
    model, padded = batches
    measured = losses.token_loss(model, padded)
    assert "entropy" not in measured
    assert measured["loss"] == pytest.approx(full_logits_loss(model, padded)[0], abs=1e-4)
