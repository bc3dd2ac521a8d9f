"""What the input contributes to the step-0 loss: input-ignored, and the cause of a loss far below chance.

The copying and boilerplate models are written out as plain `nn.Module`s (their own forward signature),
so each behaviour is exact: one copies the answer from the prompt, one predicts answers that are all the same
text, and a real tiny model with a zeroed embedding ignores what it reads.
"""

import copy
import types

import pytest
import torch

from helpers import run
from hf_sanity.testing import tiny_setup

SENTENCE = (
    "the quiet river runs past the old stone mill where children gather every summer to watch the boats drift "
    "slowly toward the sea while their parents talk about the harvest and the weather of the coming year, "
    "and nobody notices how late it has become until the lamps along the bridge are lit one by one"
)


class NextTokenOracle(torch.nn.Module):
    """Predicts, at each position, the token ``predict(ids, t)`` returns (logit 12, the rest 0)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 1)
        self.vocab = vocab

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        logits = torch.zeros(*input_ids.shape, self.vocab, device=input_ids.device)
        for b, row in enumerate(input_ids.tolist()):
            for t in range(len(row)):
                guess = self.predict(row, t)
                if guess is not None:
                    logits[b, t, guess] = 12.0
        return types.SimpleNamespace(logits=logits)


class Copier(NextTokenOracle):
    """An induction head: the token that followed the last earlier occurrence of the longest context (up to
    four, at least two tokens) ending here."""

    def predict(self, row, t):
        for width in (4, 3, 2):
            context = row[max(0, t - width + 1) : t + 1]
            for s in range(t - 1, len(context) - 2, -1):
                if row[s - len(context) + 1 : s + 1] == context:
                    return row[s + 1]
        return None


class Boilerplate(NextTokenOracle):
    """Has learned one text by heart (``ids``): continues any context of two to four tokens found in it."""

    def __init__(self, vocab, ids):
        super().__init__(vocab)
        self.ids = ids

    def predict(self, row, t):
        for width in (4, 3, 2):
            context = row[max(0, t - width + 1) : t + 1]
            for s in range(len(context) - 1, len(self.ids) - 1):
                if self.ids[s - len(context) + 1 : s + 1] == context:
                    return self.ids[s + 1]
        return None


def conversation(user, answer):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def tok():
    return tiny_setup("chatml")[1]


def below_chance(tok, rows, model):
    # the loss on the answers (as assistant-only loss puts it): these setups are about what predicts them
    report = run(
        tok, rows, model=model, select=["init-loss-off-chance", "input-ignored"], loss_on="completion"
    )
    return {f.rule: f for f in report.findings}


@pytest.mark.planted("init-loss-off-chance")
def test_answers_copied_from_the_prompt(tok):
    words = SENTENCE.split()
    rows = []
    for i in range(8):  # a different long answer each time, pasted into the request
        answer = " ".join(words[i:] + words[:i])
        rows.append(conversation(f"Please repeat this back to me exactly: {answer}", answer))
    found = below_chance(tok, rows, Copier(len(tok)))
    assert set(found) == {"init-loss-off-chance"}
    evidence = found["init-loss-off-chance"].evidence
    assert evidence["cause"] == "answer-in-input", found["init-loss-off-chance"].message
    assert evidence["answer_in_prompt"] > 0.9 and evidence["loss_prompt_blanked"] > 3
    assert "Remove the answer from the prompt" in found["init-loss-off-chance"].fix


def test_boilerplate_answers_are_predictable_without_the_prompt(tok):
    rows = [conversation(f"Question number {i}: can you help me?", SENTENCE) for i in range(8)]
    answer_ids = [
        *tok(SENTENCE, add_special_tokens=False)["input_ids"],
        tok.convert_tokens_to_ids("<|im_end|>"),
    ]
    found = below_chance(tok, rows, Boilerplate(len(tok), answer_ids))
    evidence = found["init-loss-off-chance"].evidence
    assert evidence["cause"] == "predictable-without-prompt", found["init-loss-off-chance"].message
    assert "boilerplate" in found["init-loss-off-chance"].fix


@pytest.mark.planted("input-ignored")
def test_a_model_whose_embedding_maps_every_token_to_zero(tok, conversations):
    """Weights that failed to load as zeros: every token is the same vector, the output never changes."""
    model, _ = tiny_setup("chatml")
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.get_input_embeddings().weight.zero_()
    found = below_chance(tok, conversations[:8], model)
    assert "input-ignored" in found
    assert found["input-ignored"].evidence["as_is"] == found["input-ignored"].evidence["input_blanked"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.clean("input-ignored")
def test_a_model_that_reads_its_input_is_silent(tok, conversations, dtype):
    model, _ = tiny_setup("chatml")
    model = copy.deepcopy(model).to(dtype)
    assert "input-ignored" not in below_chance(tok, conversations[:8], model)
