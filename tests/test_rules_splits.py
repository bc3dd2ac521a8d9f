"""`eval-not-random` and `split-shift`: is the eval set a random sample of the training data? Planted with the
splits people make by mistake (the tail of a file sorted by length, the head of one sorted by label, an eval
set of another source, template or label prior), through preflight and the CLI; random splits at several
seeds, sizes and eval shares are silent, and the comparison ran."""

from __future__ import annotations

import json
import random

import datasets
import pytest

from helpers import cli, run
from hf_sanity.measure import splits as splits_module
from hf_sanity.testing import demo_conversations, synthetic_conversations

RULES = ["eval-not-random", "split-shift"]


def reviews(n: int, seed: int = 0, positive: float = 0.5) -> list[dict]:
    """A sentiment task as SFT: the answer is one of two labels."""
    rng = random.Random(seed)
    good, bad = ["great", "lovely", "fine", "superb", "nice"], ["awful", "bad", "poor", "dull", "ugly"]
    rows = []
    for _ in range(n):
        label = rng.random() < positive
        words = " ".join(rng.choice(good if label else bad) for _ in range(3))
        rows.append({"messages": [
            {"role": "user", "content": f"Review: {words}, item {rng.randrange(1000)}. Sentiment?"},
            {"role": "assistant", "content": "positive" if label else "negative"},
        ]})  # fmt: skip
    return rows


def length(row) -> int:
    return sum(len(m["content"]) for m in row["messages"])


def check(tokenizer, train, eval_rows):
    report = run(tokenizer, train, select=RULES, eval_dataset=datasets.Dataset.from_list(eval_rows))
    return [f for f in report.findings if f.rule in (*RULES, "internal-error")]


@pytest.fixture
def compared(monkeypatch):
    """Every comparison made: a silent check must have compared something."""
    seen = []
    real = splits_module.compare_splits

    def spy(train, eval_rows):
        result = real(train, eval_rows)
        seen.append(result)
        return result

    monkeypatch.setattr(splits_module, "compare_splits", spy)
    return seen


# -- eval-not-random -------------------------------------------------------------------------------
@pytest.mark.planted("eval-not-random")
@pytest.mark.parametrize("end", ["tail", "head"])
def test_the_end_of_a_file_sorted_by_length(chatml, end):
    rows = sorted(demo_conversations(240), key=length)
    train, held = (rows[:215], rows[215:]) if end == "tail" else (rows[25:], rows[:25])
    [found] = check(chatml, train, held)
    assert found.rule == "eval-not-random" and found.evidence["cause"] == "sorted-slice"
    assert found.evidence["key"] == "length" and found.evidence["side"] == end
    assert f"the {end} of a source sorted by length" in found.message and "shuffle=True" in found.fix


@pytest.mark.planted("eval-not-random")
def test_the_last_rows_of_a_file_grouped_by_label(chatml):
    rows = sorted(reviews(300), key=lambda r: r["messages"][-1]["content"])
    [found] = check(chatml, rows[:270], rows[270:])
    assert found.evidence["cause"] == "sorted-slice" and found.evidence["key"] == "label"


@pytest.mark.planted("eval-not-random")
def test_a_label_prior_that_differs_beyond_sampling_noise(chatml):
    [found] = check(chatml, reviews(270), reviews(60, seed=1, positive=0.9))
    assert found.evidence["cause"] == "distribution" and "label" in found.evidence["differs"]
    label = found.evidence["differs"]["label"]
    assert label["distance"] > 1.5 * label["random_resplits_max"]


@pytest.mark.slow
@pytest.mark.planted("eval-not-random")
def test_cli_names_the_tail_of_a_sorted_file(tmp_path):
    from hf_sanity.testing import tiny_model_dir

    rows = sorted(demo_conversations(200), key=length)
    for name, part in (("train", rows[:180]), ("eval", rows[180:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    out = tmp_path / "report.json"
    result = cli("preflight", "--model", tiny_model_dir(), "--dataset", tmp_path / "train.jsonl",
                 "--eval-dataset", tmp_path / "eval.jsonl", "--select", ",".join(RULES), "--json", out)  # fmt: skip
    assert result.returncode == 0, result.stderr  # a warning
    [finding] = json.loads(out.read_text())["findings"]
    assert finding["rule"] == "eval-not-random" and finding["evidence"]["cause"] == "sorted-slice"
    assert "eval-not-random" in result.stdout


# -- split-shift -----------------------------------------------------------------------------------
@pytest.mark.planted("split-shift")
def test_an_eval_set_of_another_source(chatml):
    [found] = check(chatml, demo_conversations(240), synthetic_conversations(40, words=20))
    assert found.rule == "split-shift" and found.evidence["cause"] == "vocabulary"
    unseen = found.evidence["unseen"]["vocabulary"]
    assert unseen["share"] > 0.3 and unseen["baseline"] < 0.05 and unseen["examples"]


@pytest.mark.planted("split-shift")
def test_an_eval_set_with_another_system_prompt(chatml):
    other = [
        {
            "messages": [
                {"role": "system", "content": "You are a pirate. Answer like one."},
                *r["messages"][-2:],
            ]
        }
        for r in demo_conversations(40, seed=5)
    ]
    [found] = check(chatml, demo_conversations(200), other)
    assert found.rule == "split-shift" and found.evidence["cause"] == "system-prompt"
    assert found.evidence["unseen"]["system-prompt"]["share"] == 1.0


@pytest.mark.planted("split-shift")
def test_an_eval_set_rendered_with_another_template(chatml):
    """Train on conversations; evaluate on text rendered with Llama-3's markers (another pipeline's output)."""
    from hf_sanity.testing import build_tokenizer

    llama = build_tokenizer("llama3", "distinct")
    rendered = [
        {"text": llama.apply_chat_template(r["messages"], tokenize=False)} for r in demo_conversations(40)
    ]
    [found] = check(chatml, demo_conversations(200), rendered)
    assert found.rule == "split-shift" and found.evidence["cause"] == "dataset-format"
    assert {"dataset-format", "template"} <= set(found.evidence["causes"])


# -- clean -----------------------------------------------------------------------------------------
@pytest.mark.clean("eval-not-random", "split-shift")
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("share", [0.05, 0.2, 0.5])
def test_random_splits_are_silent(chatml, seed, share, compared):
    for rows in (
        demo_conversations(240, seed=seed % 3),
        reviews(400, seed),
        synthetic_conversations(600, seed, words=15),
    ):
        rows = rows[:]
        random.Random(seed).shuffle(rows)
        k = int(len(rows) * share)
        assert check(chatml, rows[k:], rows[:k]) == []
    assert len(compared) == 3
    for comparison in compared:  # the distributions were compared, the unseen shares measured
        assert comparison.keys["length"].distance is not None and comparison.keys["format"].noise is not None
        assert comparison.unseen["vocabulary"]["baseline"] >= 0.0 and comparison.eval.rows >= 12


@pytest.mark.clean("eval-not-random", "split-shift")
@pytest.mark.parametrize("seed", [0, 1])
def test_train_test_split_then_sorted_for_batching_is_silent(chatml, seed, compared):
    """A random split whose train part is sorted by length afterwards (for efficient batches): sorted, but
    the eval rows are a random sample of it."""
    data = datasets.Dataset.from_list(reviews(400, seed)).train_test_split(
        test_size=0.1, shuffle=True, seed=seed
    )
    train = sorted(
        data["train"].to_list(), key=lambda r: len(chatml.apply_chat_template(r["messages"])["input_ids"])
    )
    assert check(chatml, train, data["test"].to_list()) == []
    assert compared and abs(compared[0].keys["length"].train_sorted) > 0.9  # sorted indeed
