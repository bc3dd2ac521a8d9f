"""Dataset formats people have: ShareGPT and Alpaca read as the tools that use them build them, JSON-string
columns decoded, a `tools` column kept with the row; the report says how each was read."""

import json

import datasets
import pytest

from conftest import real_tokenizer
from helpers import run
from hf_sanity.errors import UserInputError
from hf_sanity.measure.encode import EncodeOptions, Encoder
from hf_sanity.measure.formats import detect_format
from hf_sanity.testing import as_prompt_completion, build_tokenizer, demo_conversations, tool_conversations
from hf_sanity.testing.data import WEATHER_TOOL

SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}


def as_sharegpt(rows):
    return [
        {"conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in r["messages"]]}
        for r in rows
    ]


def as_alpaca(rows):
    """One Alpaca row per distinct last exchange: the question as the instruction, every third with an input."""
    out, seen = [], set()
    for i, row in enumerate(rows):
        question, answer = row["messages"][-2]["content"], row["messages"][-1]["content"]
        given = f"(asked {i} times)" if i % 3 == 0 else ""
        if (question, given) not in seen:
            seen.add((question, given))
            out.append({"instruction": question, "input": given, "output": answer})
    return out


def encoded(tokenizer, fmt, row, **options):
    out = Encoder(tokenizer, EncodeOptions(fmt=fmt, **options)).encode(row)
    assert out["error"] == "", out["error"]
    return out["input_ids"], out["labels"]


# -- detection ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "columns, fmt",
    [
        (["conversations"], "sharegpt"),
        (["conversations", "tools", "system"], "sharegpt"),
        (["instruction", "input", "output"], "alpaca"),
        (["instruction", "output"], "alpaca"),
        # TRL trains on a `text` column when there is one.
        (["instruction", "input", "output", "text"], "text"),
        (["messages", "tools"], "messages"),
        (["prompt", "completion", "tools"], "prompt-completion"),
    ],
)
def test_formats_are_detected_from_the_columns(columns, fmt):
    assert detect_format(columns) == fmt


def test_an_unknown_layout_names_every_format():
    with pytest.raises(UserInputError) as exc:
        detect_format(["question", "answer"])
    message = str(exc.value)
    assert "`conversations` (ShareGPT)" in message and "`instruction`+`output` (Alpaca)" in message


# -- ShareGPT -------------------------------------------------------------------------------------------------
@pytest.mark.clean("data", "tokens", "template")
def test_sharegpt_is_read_as_the_same_conversations(chatml, conversations):
    rows = as_sharegpt(conversations[:24])
    # Loss on the answers, as Axolotl and LLaMA-Factory train ShareGPT rows (TRL: every token); "completion", as
    # the template stage's generation-markers-missing holds TRL's assistant_only_loss to its markers.
    report = run(chatml, rows, select=["data", "tokens", "template"], loss_on="completion")
    assert report.findings == []
    assert report.stats["format"] == "sharegpt" and report.stats["read_as"] == "messages"
    assert report.stats["roles"] == {"gpt": "assistant", "human": "user", "system": "system"}
    for sharegpt, messages in zip(rows, conversations[:24]):
        assert encoded(chatml, "sharegpt", sharegpt) == encoded(chatml, "messages", messages)


def test_sharegpt_roles_as_axolotl_and_llama_factory_map_them(chatml):
    row = {"conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "user", "value": "Hi there, who are you?"},
        {"from": "model", "value": "A helpful assistant."}, {"from": "human", "value": "Thanks."},
        {"from": "assistant", "value": "You are welcome."},
    ]}  # fmt: skip
    messages = [{"role": r, "content": m["value"]} for r, m in
                zip(["system", "user", "assistant", "user", "assistant"], row["conversations"])]  # fmt: skip
    assert encoded(chatml, "sharegpt", row) == encoded(chatml, "messages", {"messages": messages})
    report = run(chatml, [row], format="sharegpt", select="bad-input-values")
    assert report.findings == []
    assert report.stats["roles"] == {
        "assistant": "assistant", "human": "user", "model": "assistant", "system": "system", "user": "user"
    }  # fmt: skip


def test_sharegpt_unknown_role_is_named(chatml, conversations):
    rows = as_sharegpt(conversations[:4])
    rows[2]["conversations"][-1]["from"] = "bot"
    (finding,) = run(chatml, rows, select="bad-input-values").findings
    assert finding.evidence["rows"] == [2]
    assert "unknown ShareGPT role 'bot'" in finding.message


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "llama3-instruct"])
def test_sharegpt_tool_calls_as_llama_factory_writes_them(name):
    """function_call (the assistant's call, as JSON) and observation (the tool's result) turns, with the tools
    in a `tools` column of JSON text: rendered exactly as the same conversation in TRL's messages format."""
    tok = real_tokenizer(name)
    trl_rows = tool_conversations(6)
    rows = []
    for row in trl_rows:
        user, call, result, answer = row["messages"]
        rows.append({
            "conversations": [
                {"from": "human", "value": user["content"]},
                {"from": "function_call", "value": json.dumps(call["tool_calls"][0]["function"])},
                {"from": "observation", "value": result["content"]},
                {"from": "gpt", "value": answer["content"]},
            ],
            "tools": json.dumps([WEATHER_TOOL]),
        })  # fmt: skip
    report = run(tok, rows, select=["data", "tokens"], loss_on="assistant")  # LLaMA-Factory's loss mask
    assert [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"] == []
    assert report.stats["template_columns"] == ["tools"]
    roles = report.stats["roles"]
    assert roles["function_call"] == "assistant" and roles["observation"] == "tool"
    for sharegpt, trl in zip(rows, trl_rows):
        trl = {**trl, "messages": [{k: v for k, v in m.items() if k != "name"} for m in trl["messages"]]}
        assert encoded(tok, "sharegpt", sharegpt) == encoded(tok, "messages", trl)


# -- Alpaca ---------------------------------------------------------------------------------------------------
@pytest.mark.clean("data", "tokens", "template")
def test_alpaca_through_the_chat_template(chatml, conversations):
    rows = as_alpaca(conversations[:24])
    report = run(chatml, rows, select=["data", "tokens", "template"])
    assert report.findings == []
    assert report.stats["format"] == "alpaca" and report.stats["alpaca_template"] == "chat"
    for row in rows:  # LLaMA-Factory's user turn: instruction and input, joined by a newline
        user = row["instruction"] + ("\n" + row["input"] if row["input"] else "")
        trl = {"prompt": [{"role": "user", "content": user}],
               "completion": [{"role": "assistant", "content": row["output"]}]}  # fmt: skip
        assert encoded(chatml, "alpaca", row) == encoded(chatml, "prompt-completion", trl)


@pytest.mark.clean("data", "tokens", "template")
def test_alpaca_text_template_for_a_base_model(conversations):
    base = build_tokenizer("base")  # no chat template: the Alpaca prompt is the default
    rows = as_alpaca(conversations[:24])
    report = run(base, rows, select=["data", "tokens", "template"])
    assert report.findings == []  # its `### Instruction:` scaffolding is not a stray marker
    assert report.stats["alpaca_template"] == "text"
    ids, labels = encoded(base, "alpaca", rows[0])
    prompt = (  # Stanford Alpaca's prompt_input
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        f"Write a response that appropriately completes the request.\n\n### Instruction:\n{rows[0]['instruction']}\n\n"
    )
    prompt += f"### Input:\n{rows[0]['input']}\n\n### Response:\n"
    assert base.decode(ids).startswith(prompt)
    supervised = base.decode([t for t in labels if t != -100])
    assert supervised.strip() == rows[0]["output"] + base.eos_token


def test_alpaca_template_is_a_choice(chatml, conversations):
    rows = as_alpaca(conversations[:4])
    report = run(chatml, rows, alpaca_template="text", select="data")
    assert report.stats["alpaca_template"] == "text"
    with pytest.raises(UserInputError, match="--alpaca-template must be 'chat' or 'text'"):
        run(chatml, rows, alpaca_template="markdown")


def test_alpaca_rows_without_output_are_named(chatml, conversations):
    rows = as_alpaca(conversations[:4])
    rows[1]["output"] = None
    (finding,) = run(chatml, rows, select="bad-input-values").findings
    assert finding.evidence["rows"] == [1] and "output is None" in finding.message


# -- JSON-string columns --------------------------------------------------------------------------------------
@pytest.mark.clean("data", "tokens", "template")
def test_json_string_messages_are_decoded(chatml, conversations):
    rows = [{"messages": json.dumps(r["messages"])} for r in conversations[:24]]
    report = run(chatml, rows, select=["data", "tokens", "template"], loss_on="completion")
    assert report.findings == []
    assert report.stats["json_columns"] == ["messages"]
    assert encoded(chatml, "messages", rows[0]) == encoded(chatml, "messages", conversations[0])


def test_strings_that_are_no_message_list_say_so(chatml, conversations):
    rows = [{"messages": json.dumps(r["messages"])} for r in conversations[:4]]
    rows[1]["messages"] = "hello there"
    rows[3]["messages"] = json.dumps({"role": "user", "content": "hi"})
    (finding,) = run(chatml, rows, select="bad-input-values").findings
    assert finding.evidence["rows"] == [1, 3]
    assert "column `messages` holds a string that is not JSON" in finding.message
    reasons = " ".join(finding.evidence["reasons"])
    assert "holds strings; expected a list of messages (JSON-decode it)" in reasons


def test_json_string_conversational_prompt_completion(chatml, conversations):
    rows = [{"prompt": json.dumps(r["messages"][:-1]), "completion": json.dumps(r["messages"][-1:])}
            for r in conversations[:6]]  # fmt: skip
    report = run(chatml, rows, select="data")
    assert report.findings == [] and report.stats["json_columns"] == ["prompt", "completion"]
    plain = [{"prompt": "[INST] What is 2 plus 2? [/INST]", "completion": "4, written as four."}]
    assert "json_columns" not in run(chatml, plain, select="data").stats  # text that merely starts with [


def test_sharegpt_csv_of_json_strings(chatml, conversations, tmp_path):
    rows = [{"conversations": json.dumps(r["conversations"])} for r in as_sharegpt(conversations[:8])]
    path = tmp_path / "train.csv"
    datasets.Dataset.from_list(rows).to_csv(str(path))
    data = datasets.load_dataset("csv", data_files=str(path), split="train")
    report = run(chatml, data, select="data")
    assert report.findings == []
    assert report.stats["json_columns"] == ["conversations"]
    assert report.stats["roles"] == {"gpt": "assistant", "human": "user", "system": "system"}


def test_tool_conversations_from_a_csv_are_rendered_with_their_tools():
    """A CSV holds the messages (with their tool calls) and the `tools` column as JSON text: both decoded, the
    tools passed to the chat template, exactly as TRL renders the same rows."""
    tok = real_tokenizer("qwen2.5-instruct")
    rows = tool_conversations(6, tools_as_json=True)
    as_csv = [{"messages": json.dumps(r["messages"]), "tools": r["tools"]} for r in rows]
    report = run(tok, as_csv, select=["data", "tokens"], loss_on="assistant")
    assert [f"{f.rule}: {f.message}" for f in report.findings if f.severity != "info"] == []
    assert report.stats["json_columns"] == ["messages"] and report.stats["template_columns"] == ["tools"]
    for row, original in zip(as_csv, rows):
        ids, _ = encoded(tok, "messages", row)
        trl = tok.apply_chat_template(
            original["messages"], tools=json.loads(original["tools"]), return_dict=True
        )
        assert ids == trl["input_ids"]


@pytest.mark.clean("template-mismatch")
def test_inference_parity_renders_the_rows_tools():
    """The same tokenizer at inference renders tool-call conversations with their `tools` as training did: no
    template-mismatch (it compared against a rendering without the tools)."""
    tok = real_tokenizer("qwen2.5-instruct")
    for rows in (tool_conversations(8), tool_conversations(8, tools_as_json=True)):
        assert run(tok, rows, select="template-mismatch", inference_tokenizer=tok).findings == []


# -- a `label` column: KTO's only where it is boolean ----------------------------------------------------------
def labelled_rows(label) -> list[dict]:
    """24 prompt/completion rows with a `label` column; every completion opens with its prompt (a planted SFT
    bug: answer-repeats-prompt)."""
    rows = []
    for i, row in enumerate(as_prompt_completion(demo_conversations(24))):
        prompt = f"Classify the sentiment of this review, number {i}: the food was lovely."
        rows.append({"prompt": prompt, "completion": f"{prompt} {row['completion']}", "label": label(i)})
    return rows


@pytest.mark.planted("answer-repeats-prompt")
def test_a_string_label_column_is_sft_data(chatml):
    """Classification-style SFT: `label` holds strings, so the rows are SFT prompt-completion rows, not KTO's
    (TRL's KTOTrainer needs a boolean label): the SFT rules run and find the planted bug, and the notes say
    how the rows were read."""
    report = run(chatml, labelled_rows(lambda i: "positive" if i % 2 else "negative"), select="data")
    assert report.stats["objective"] == "sft" and report.stats["format"] == "prompt-completion"
    (finding,) = report.findings
    assert finding.rule == "answer-repeats-prompt" and finding.evidence["rows"][:3] == [0, 1, 2]
    (note,) = report.notes
    assert "`label` column holds string values, not booleans: read as SFT prompt-completion data" in note
    assert "--format preference-unpaired" in note


def test_a_boolean_label_column_is_kto_data(chatml):
    report = run(chatml, labelled_rows(lambda i: i % 2 == 0), select="data")
    assert report.stats["objective"] == "preference-unpaired" and report.notes == []
    assert report.by_rule("answer-repeats-prompt") == []  # an SFT rule: not run on KTO rows
    assert (
        detect_format(["prompt", "completion", "label"]) == "preference-unpaired"
    )  # no types: KTO's columns
