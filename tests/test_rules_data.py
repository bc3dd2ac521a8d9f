"""Data rules: each planted bug triggers its rule; the clean demo data triggers none."""

import json

import datasets
import pytest

from conftest import real_tokenizer
from helpers import cli, extractive_qa, run
from hf_sanity.measure.encode import system_merged
from hf_sanity.testing import as_prompt_completion, tiny_model_for


@pytest.mark.clean("data", "bad-input-values", "split-leakage")
def test_clean_data_is_silent(chatml, conversations):
    report = run(
        chatml, conversations[:40], select="data", eval_dataset=datasets.Dataset.from_list(conversations[40:])
    )
    assert report.findings == []


@pytest.mark.planted("bad-input-values")
def test_bad_input_values_lists_rows_and_reasons(chatml, conversations):
    rows = [dict(r) for r in conversations[:10]]
    rows[2] = {"messages": []}
    rows[5] = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    rows[7] = {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    report = run(chatml, rows, select="bad-input-values")
    (finding,) = report.findings
    assert finding.severity == "error"
    assert finding.evidence["rows"] == [2, 5, 7]
    assert finding.message.startswith("3 of 10 rows")
    assert any("unknown role" in reason for reason in finding.evidence["reasons"])
    assert "cause" not in finding.evidence


@pytest.mark.slow
@pytest.mark.planted("bad-input-values")
def test_mistral_refuses_the_system_turn_and_the_fix_merges_it(tmp_path, conversations):
    """`hf-sanity preflight` with Mistral Instruct's tokenizer on conversations of which a third open with a
    system turn: its template raises on them. The cause is the system role the template refuses, and the fix
    merges the system prompt into the first user turn instead of dropping a third of the data."""
    tok = real_tokenizer("mistral-instruct")
    model_dir, data, out = tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "report.json"
    tiny_model_for(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data.write_text("\n".join(json.dumps(r) for r in conversations) + "\n")
    result = cli("preflight", "--model", model_dir, "--dataset", data, "--json", out, "--select", "data")
    assert result.returncode == 1, result.stdout + result.stderr
    (finding,) = json.loads(out.read_text())["findings"]
    with_system = [i for i, r in enumerate(conversations) if r["messages"][0]["role"] == "system"]
    assert finding["rule"] == "bad-input-values" and finding["evidence"]["cause"] == "system-role-refused"
    assert finding["evidence"]["system_refused"] == finding["evidence"]["count"] == len(with_system)
    assert "merge the system prompt into the first user turn" in finding["fix"]
    assert "Drop or repair" not in finding["fix"]
    merged = [{"messages": system_merged(r["messages"]) or r["messages"]} for r in conversations]
    assert run(tok, merged, select="bad-input-values").findings == []  # the fix, applied


@pytest.mark.planted("bad-input-values")
def test_rows_refused_for_their_system_turn_among_other_bad_rows(conversations):
    tok = real_tokenizer("mistral-instruct")
    rows = [r for r in conversations[:12] if r["messages"][0]["role"] != "system"]
    rows[1] = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    rows.append(conversations[0])  # a system turn
    (finding,) = run(tok, rows, select="bad-input-values").findings
    assert finding.evidence["cause"] == "system-role-refused" and finding.evidence["system_refused"] == 1
    assert finding.evidence["count"] == 2 and "The other 1 row fails for other reasons" in finding.fix


def test_bad_input_values_text_and_prompt_completion(chatml):
    report = run(chatml, [{"text": "fine"}, {"text": ""}, {"text": None}], select="bad-input-values")
    assert report.findings[0].evidence["rows"] == [1, 2]
    pc = [{"prompt": "Q", "completion": "A"}, {"prompt": "Q", "completion": None}]
    assert run(chatml, pc, select="bad-input-values").findings[0].evidence["rows"] == [1]


def test_rows_the_template_rejects(conversations):
    from hf_sanity.testing import build_tokenizer

    tok = build_tokenizer("chatml")
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}{{ m['content'] }}{% endfor %}"
    report = run(tok, conversations[:6], select="bad-input-values")
    (finding,) = report.findings
    assert finding.evidence["rows"] == [0, 3]  # the rows with a system prompt
    assert "no system" in finding.message


@pytest.mark.planted("duplicate-examples")
def test_duplicate_examples(chatml, conversations):
    rows = conversations[:20] + [conversations[3], conversations[3], conversations[11]]
    # Case and whitespace do not make an example new.
    shouty = {
        "messages": [{**m, "content": "  " + m["content"].upper()} for m in conversations[5]["messages"]]
    }
    report = run(chatml, [*rows, shouty], select="duplicate-examples")
    (finding,) = report.findings
    assert finding.severity == "warning"
    assert finding.evidence["duplicates"] == 4
    assert [3, 20] in finding.evidence["pairs"] and [5, 23] in finding.evidence["pairs"]


@pytest.mark.planted("split-leakage")
def test_split_leakage(chatml, conversations):
    eval_rows = conversations[40:48] + conversations[:2]
    report = run(
        chatml, conversations[:40], select="split-leakage", eval_dataset=datasets.Dataset.from_list(eval_rows)
    )
    (finding,) = report.findings
    assert finding.evidence["overlap"] == 2 and finding.evidence["eval_rows"] == [8, 9]
    clean = run(chatml, conversations[:40], select="split-leakage",
                eval_dataset=datasets.Dataset.from_list(conversations[40:48]))  # fmt: skip
    assert clean.findings == []


@pytest.mark.planted("label-leakage")
def test_label_leakage(chatml, conversations):
    rows = as_prompt_completion(conversations[:10])
    rows[4] = {"prompt": "Context: The capital of Norway is Oslo and it is cold.\nQuestion: capital?\n",
               "completion": "The capital of Norway is Oslo and it is cold."}  # fmt: skip
    report = run(chatml, rows, select="label-leakage")
    (finding,) = report.findings
    assert finding.evidence["rows"] == [4]
    # Short answers that happen to occur in the question are not leakage.
    short = [{"prompt": "Is it Paris or Rome?", "completion": "Paris"}]
    assert run(chatml, short, select="label-leakage").findings == []


@pytest.mark.planted("label-leakage")
def test_label_leakage_answer_pasted_at_the_end_of_a_long_prompt(chatml):
    """A formatting function that appends the reference to the prompt: the answer is a small part of a long
    context, but the prompt ends with it. It fires with the numbers, and `task="extractive"` turns it off."""
    rows = extractive_qa(30)
    for i in (3, 7, 11):
        rows[i] = {**rows[i], "prompt": rows[i]["prompt"] + rows[i]["completion"] + "\n"}
    (finding,) = run(chatml, rows, select="label-leakage").findings
    assert finding.evidence["rows"] == [3, 7, 11] and finding.evidence["at_prompt_end"] == 3
    assert finding.evidence["quoted_spans"] == 27  # the other rows quote their context: not counted
    assert 0 < finding.evidence["answer_prompt_ratio"] < 0.2
    assert finding.message.startswith("in 3 of 30 examples (10.0%) the answer is pasted into the prompt")
    report = run(chatml, rows, select="label-leakage", task="extractive")
    assert report.findings == [] and report.stats["task"] == "extractive"


@pytest.mark.clean("label-leakage")
def test_extractive_answers_quoted_from_a_long_context_are_not_leakage(chatml):
    assert run(chatml, extractive_qa(30), select="label-leakage").findings == []


def test_a_later_turn_quoting_the_answer_is_not_leakage(chatml):
    """The user repeating an answer after it was given is history, not the answer in the input."""
    answer = "The capital of Norway is Oslo, a city by the fjord."
    messages = [
        {"role": "user", "content": "What is the capital of Norway?"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": f"You said: {answer}"},
        {"role": "assistant", "content": "Yes, that is right."},
    ]
    assert run(chatml, [{"messages": messages}], select="label-leakage").findings == []


def test_findings_carry_every_offending_row(chatml, conversations):
    """The evidence lists ten rows; the finding keeps them all, for `--rows-out` and dataset.filter."""
    rows = [dict(r) for r in conversations[:40]]
    broken = list(range(0, 40, 3))  # 14 rows
    for i in broken:
        rows[i] = {"messages": []}
    rows += [conversations[1], conversations[2], conversations[1]]  # rows 40-42 repeat rows 1, 2, 1
    report = run(chatml, rows, select=["bad-input-values", "duplicate-examples"])
    bad = report.by_rule("bad-input-values")[0]
    assert bad.evidence["rows"] == broken[:10] and bad.rows == broken
    assert report.offending_rows() == {"bad-input-values": broken, "duplicate-examples": [40, 41, 42]}


@pytest.mark.planted("answer-repeats-prompt")
def test_completions_built_as_prompt_plus_answer(chatml):
    """The data of the echoing fixture (hf_sanity.testing.trained): each answer opens with the user's message.
    Upstream of `hf-sanity outputs`' repeats-prompt, caught before training, in either format."""
    from hf_sanity.testing import as_prompt_completion
    from hf_sanity.testing.trained import training_conversations

    rows = training_conversations("prompt-in-answer")[:32]
    for data in (rows, as_prompt_completion(rows, conversational=True)):
        (finding,) = run(chatml, data, select="answer-repeats-prompt").findings
        assert finding.severity == "error" and finding.evidence["fraction"] > 0.5  # prompts of 20+ characters
    one = [*training_conversations("clean")[:31], rows[0]]
    (finding,) = run(chatml, one, select="answer-repeats-prompt").findings
    assert finding.severity == "warning" and finding.evidence["rows"] == [31]


@pytest.mark.clean("answer-repeats-prompt")
def test_answers_that_restate_the_question_in_their_own_words_are_not_echoes(chatml, conversations):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "What is the capital of France, please?"},
                {"role": "assistant", "content": "The capital of France is Paris."},
            ]
        }
    ] * 4
    assert run(chatml, [*conversations, *rows], select="answer-repeats-prompt").findings == []
