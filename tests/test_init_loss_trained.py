"""`init-loss-off-chance` on a model that is already trained (continued fine-tuning), through preflight in
Python, the CLI and the callback's first step of a real Trainer run.

A model fine-tuned on the demo chats scores the same kind of rows at ~0.07 nats: a warning that says what was
measured (`seen-data`), never an error. Rows in a new answer style cost it more than its own entropy, even
more than ln(V): that is new data (`new-data`, info), not wrong labels. Labels that are wrong on the same
model stay errors, each with its cause: shifted by hand (`labels-shifted`: scored one position earlier they
fit), lagging the input (`labels-shifted`), or not the input's tokens (`labels-not-input`).
"""

from __future__ import annotations

import copy
import json
import random

import pytest

from helpers import cli, run
from hf_sanity.callback import SanityCallback
from hf_sanity.testing import (
    held_out_conversations,
    synthetic_conversations,
    trained_model_dir,
    trained_setup,
)
from hf_sanity.testing.trained import supervised_labels

RULE = "init-loss-off-chance"
# The model was trained on the answers only (`supervised_labels`): its step-0 loss is read on them too.
ANSWERS = {"loss_on": "completion"}


@pytest.fixture(scope="module")
def trained():
    return trained_setup("clean")


def restyled(rows, answer):
    """``rows`` with every assistant answer rewritten by ``answer(text)``: a style the model never saw."""
    out = []
    for row in rows:
        messages = [
            {**m, "content": answer(m["content"])} if m["role"] == "assistant" else m for m in row["messages"]
        ]
        out.append({"messages": messages})
    return out


NEW_STYLES = {
    "shouted": lambda a: a.upper(),
    "chatty": lambda a: f"Let me think about that carefully. {a} I hope this helps you today!",
    "words reversed": lambda a: " ".join(reversed(a.split())),
    "random words": None,  # synthetic_conversations: nothing like the demo chats at all
}


def new_style_rows(style: str, seed: int):
    if NEW_STYLES[style] is None:
        return synthetic_conversations(16, seed=seed)
    return restyled(held_out_conversations(32, seed=seed + 1), NEW_STYLES[style])


def tokenized(tok, rows):
    """Pre-tokenized rows (the `tokens` format), the loss on every assistant turn."""
    return [
        dict(zip(("input_ids", "labels"), supervised_labels(tok, r["messages"]), strict=True)) for r in rows
    ]


def shifted_by_hand(row):
    """labels[i] = input_ids[i + 1] on the supervised positions: shifted once more by the model."""
    ids, labels = row["input_ids"], row["labels"]
    return {
        "input_ids": ids,
        "labels": [ids[i + 1] if labels[i + 1] != -100 else -100 for i in range(len(ids) - 1)] + [-100],
    }


def lagging(row):
    ids, labels = row["input_ids"], row["labels"]
    return {
        "input_ids": ids,
        "labels": [-100] + [ids[i - 1] if labels[i] != -100 else -100 for i in range(1, len(ids))],
    }


def random_labels(row, seed: int = 0, vocab: int = 1000):
    rng = random.Random(seed + len(row["input_ids"]))
    return {
        "input_ids": row["input_ids"],
        "labels": [rng.randrange(vocab) if lab != -100 else -100 for lab in row["labels"]],
    }


# -- preflight, Python -------------------------------------------------------------------------------
@pytest.mark.clean("init-loss-off-chance")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_rows_like_the_training_data_are_a_seen_data_warning_that_says_what_was_measured(trained, seed):
    model, tok = trained
    report = run(tok, held_out_conversations(32, seed=seed), model=model, select=RULE, **ANSWERS)
    (finding,) = report.findings
    assert finding.severity == "warning" and finding.evidence["cause"] == "seen-data", finding.message
    assert finding.evidence["direction"] == "below" and finding.evidence["loss"] < 0.2
    assert f"with the prompts blanked it is {finding.evidence['loss_prompt_blanked']:.2f}" in finding.message
    assert report.stats["step0_loss"]["loss"] == finding.evidence["loss"]  # the detector ran, and said so


@pytest.mark.clean("init-loss-off-chance")
@pytest.mark.parametrize("style", list(NEW_STYLES))
@pytest.mark.parametrize("seed", [0, 1])
def test_a_new_answer_style_on_a_trained_model_is_new_data_not_wrong_labels(trained, style, seed):
    model, tok = trained
    report = run(tok, new_style_rows(style, seed), model=model, select=RULE, **ANSWERS)
    (finding,) = report.findings
    evidence = finding.evidence
    assert finding.severity == "info" and evidence["cause"] == "new-data", finding.message
    assert evidence["direction"] == "above" and evidence["loss"] > evidence["model_entropy"] + 2


def test_the_message_names_what_the_loss_was_compared_with(trained):
    """Below ln(V) but far above the model's own entropy: the message says entropy, not chance."""
    model, tok = trained
    rows = restyled(held_out_conversations(32), lambda a: f"Sure. {a}")
    (finding,) = run(tok, rows, model=model, select=RULE, **ANSWERS).findings
    loss, entropy, chance = (finding.evidence[k] for k in ("loss", "model_entropy", "ln_vocab"))
    assert entropy + 2 < loss < chance, finding.message
    assert finding.message.startswith(
        f"step-0 loss {loss:.2f} is far above the model's own predictive entropy {entropy:.2f} "
        f"(chance ln(V)={chance:.2f})"
    )
    assert "far above chance" not in finding.message


@pytest.mark.planted("init-loss-off-chance")
@pytest.mark.parametrize(
    ("wrong", "cause", "alignment"),
    [
        (shifted_by_hand, "labels-shifted", "label_before"),
        (lagging, "labels-shifted", "label_after"),
        (random_labels, "labels-not-input", "input_next"),
    ],
)
def test_wrong_labels_on_a_trained_model_are_an_error_with_their_cause(trained, wrong, cause, alignment):
    model, tok = trained
    rows = [wrong(r) for r in tokenized(tok, held_out_conversations(32))]
    (finding,) = run(tok, rows, model=model, select=RULE, **ANSWERS).findings
    evidence = finding.evidence
    assert finding.severity == "error" and evidence["cause"] == cause, finding.message
    assert evidence["alignment"] == alignment and evidence["loss_aligned"] < 0.5 * evidence["loss"]
    assert evidence["loss"] > evidence["ln_vocab"]


@pytest.mark.planted("init-loss-off-chance")
def test_a_trained_model_re_initialised_after_loading_predicts_nothing(trained):
    model, tok = trained
    broken = copy.deepcopy(model)
    import torch

    with torch.no_grad():
        for p in broken.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0)  # re-initialised after loading, far too wide
    (finding,) = run(tok, held_out_conversations(32), model=broken, select=RULE, **ANSWERS).findings
    assert finding.severity == "error" and finding.evidence["cause"] == "nothing-predicted", finding.message
    assert finding.evidence["top1"] < 0.02


# -- the CLI -----------------------------------------------------------------------------------------
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.clean("init-loss-off-chance")
def test_cli_continued_fine_tuning_is_not_an_error(tmp_path):
    model = trained_model_dir("clean")
    for name, rows, cause, severity in (
        ("seen", held_out_conversations(32), "seen-data", "warning"),
        ("new", new_style_rows("chatty", 0), "new-data", "info"),
    ):
        out = tmp_path / f"{name}.json"
        # the step-0 loss on the answers, as these continued fine-tunes train
        done = cli("preflight", "--model", model, "--dataset", write_jsonl(tmp_path / f"{name}.jsonl", rows),
                   "--select", RULE, "--loss-on", "completion", "--json", out)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        (finding,) = json.loads(out.read_text())["findings"]
        assert (finding["evidence"]["cause"], finding["severity"]) == (cause, severity), finding["message"]


@pytest.mark.slow
@pytest.mark.planted("init-loss-off-chance")
def test_cli_shifted_labels_on_a_trained_model_are_an_error(tmp_path, trained):
    _, tok = trained
    rows = [shifted_by_hand(r) for r in tokenized(tok, held_out_conversations(32))]
    out = tmp_path / "report.json"
    done = cli("preflight", "--model", trained_model_dir("clean"), "--dataset",
               write_jsonl(tmp_path / "shifted.jsonl", rows), "--select", RULE, "--json", out)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    (finding,) = json.loads(out.read_text())["findings"]
    assert finding["severity"] == "error" and finding["evidence"]["cause"] == "labels-shifted"


# -- the callback's first step -----------------------------------------------------------------------
def first_steps(tmp_path, model, tok, rows, collator=None):
    from dist import tinytrain as tt

    watch = SanityCallback(abort_on="error", select=RULE, use_config=False, print_findings=False)
    trainer = tt.trainer(tmp_path / "out", callbacks=[watch], model=copy.deepcopy(model), tok=tok,
                         data=rows, collator=collator, max_steps=2, learning_rate=1e-4)  # fmt: skip
    trainer.train()
    return trainer, watch


@pytest.mark.clean("init-loss-off-chance")
def test_callback_continued_fine_tuning_runs_on(tmp_path, trained):
    model, tok = trained
    for name, rows, cause, severity in (
        ("seen", held_out_conversations(32), "seen-data", "warning"),
        ("new", new_style_rows("shouted", 0), "new-data", "info"),
    ):
        trainer, watch = first_steps(tmp_path / name, model, tok, tokenized(tok, rows))
        (finding,) = watch.report.findings
        assert finding.step == 1 and finding.evidence["cause"] == cause, finding.message
        assert finding.severity == severity
        assert trainer.state.global_step == 2 and trainer.state.hf_sanity_aborted_at_step is None


@pytest.mark.planted("init-loss-off-chance")
@pytest.mark.parametrize(
    ("wrong", "cause"), [(shifted_by_hand, "labels-shifted"), (random_labels, "labels-not-input")]
)
def test_callback_wrong_labels_on_a_trained_model_stop_the_run_at_step_1(tmp_path, trained, wrong, cause):
    model, tok = trained
    rows = [wrong(r) for r in tokenized(tok, held_out_conversations(32))]
    trainer, watch = first_steps(tmp_path, model, tok, rows)
    (finding,) = watch.report.findings
    assert (finding.step, finding.severity, finding.evidence["cause"]) == (1, "error", cause), finding.message
    assert trainer.state.hf_sanity_aborted_at_step == 1


def test_the_probe_and_preflight_measure_the_same_numbers(trained):
    """The callback's probe (full logits) and preflight's chunked scorer agree on what the rule reads."""
    import torch

    from hf_sanity.measure.losses import token_loss
    from hf_sanity.measure.tensors import pad_batches
    from hf_sanity.training.probe import probe

    model, tok = trained
    rows = [shifted_by_hand(r) for r in tokenized(tok, held_out_conversations(4))]
    (batch,) = pad_batches([(r["input_ids"], r["labels"]) for r in rows], tok.pad_token_id)
    probed = probe(model, batch, stats=True)["stats"]
    scored = token_loss(model, [batch], max_tokens=None, detail=True)
    for key in ("loss", "entropy", "top1", "tokens", "label_entropy"):
        assert probed[key] == pytest.approx(scored[key], abs=1e-4), key
    for name, other in scored["alignments"].items():
        assert probed["alignments"][name] == pytest.approx(other, abs=1e-4)
    assert torch.is_tensor(batch["labels"])
