"""The optimised paths measure what the plain ones do: each shortcut against the straightforward computation
it replaces, on inputs chosen to break it (Unicode case rules, empty texts, odd whitespace)."""

from __future__ import annotations

import pytest

from conftest import REAL_TOKENIZERS, real_tokenizer
from hf_sanity.measure.encode import EncodeOptions, Encoder, normalize, stable_hash
from hf_sanity.measure.markers import WhitespaceIds, whitespace_token_ids
from hf_sanity.testing import build_tokenizer, demo_conversations, tool_conversations
from hf_sanity.testing.factory import TEMPLATES


@pytest.mark.parametrize("template", TEMPLATES)
def test_whitespace_ids_lazy_matches_vocabulary_scan_tiny(template):
    tok = build_tokenizer(template)
    lazy = WhitespaceIds(tok)
    assert {i for i in range(len(tok) + 3) if i in lazy} == whitespace_token_ids(tok)
    assert -100 not in lazy and None not in lazy and [1] not in lazy


@pytest.mark.parametrize(
    "name", sorted(p.name for p in REAL_TOKENIZERS.glob("*") if p.is_dir()) or ["qwen2.5-instruct"]
)
def test_whitespace_ids_lazy_matches_vocabulary_scan_real(name):
    tok = real_tokenizer(name)
    lazy = WhitespaceIds(tok)
    assert {i for i in range(len(tok) + 3) if i in lazy} == whitespace_token_ids(tok)


TRICKY = [
    "ΟΔΟΣ ΣΟΦΟΣ: Σ",  # Greek final sigma depends on what follows a capital sigma
    "  leading and trailing  \n\t",
    "",
    "İstanbul ǅemal ß ﬁ",  # lowercases that change length
    "a\u00a0non-breaking\u2003em\u3000ideographic\x1cfile-separator\u2028line",
    "the answer is the answer is the answer is the answer",
]


def _rows():
    rows = demo_conversations(24) + tool_conversations(6)
    for k, text in enumerate(TRICKY):
        answer = TRICKY[(k + 5) % len(TRICKY)] or "ΣΟΦΟΣ and more than twenty characters"
        system = [{"role": "system", "content": text}] if text.strip() else []
        rows.append(
            {
                "messages": [
                    *system,
                    {"role": "user", "content": f"{text} {answer} ΑΣ"},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"ΣΑΣ{text}"},
                    {"role": "assistant", "content": f"{answer}  {text}"},
                ]
            }
        )
    return rows


def _reference_leaks(encoder, messages):
    from hf_sanity.measure.encode import text_of

    texts = [(m["role"], text_of(m)) for m in messages]
    answers = [
        (" ".join(t for r, t in texts[:j] if r != "assistant"), text)
        for j, (role, text) in enumerate(texts)
        if role == "assistant"
    ]
    return texts, encoder._leaks(answers)


def test_conversation_hash_and_leak_match_normalizing_the_joined_texts():
    """Each text is split into words once; the hash and the leak measure equal those of the joined texts."""
    tok = build_tokenizer("chatml")
    encoder = Encoder(tok, EncodeOptions(fmt="messages"))
    leaks = 0
    for row in _rows():
        out = encoder.encode(row)
        assert out["error"] == ""
        texts, (ratio, after) = _reference_leaks(encoder, row["messages"])
        assert out["hash"] == stable_hash(normalize(" ".join(f"{role}: {text}" for role, text in texts)))
        assert (out["leak"], out["leak_after"]) == (ratio, after)
        leaks += ratio > 0
    assert leaks >= 3  # the answers pasted into the prompts were found


def test_batched_call_matches_row_by_row():
    """`datasets.map` calls the encoder on batches (with the cyclic collector paused): same rows out."""
    import gc

    tok = build_tokenizer("chatml")
    encoder = Encoder(tok, EncodeOptions(fmt="messages", max_len=64))
    rows = _rows()
    batch = encoder({"messages": [r["messages"] for r in rows]})
    assert gc.isenabled()
    for k, row in enumerate(rows):
        single = encoder.encode(row)
        assert {key: values[k] for key, values in batch.items()} == single


@pytest.mark.parametrize(
    "rows",
    [
        [{"messages": r["messages"]} for r in demo_conversations(40)],
        [{"text": f"plain text number {i}"} for i in range(10)],
        [{"input_ids": [5, 6, 7 + i], "labels": [-100, 6, 7 + i]} for i in range(10)],
    ],
    ids=["messages", "text", "tokens"],
)
def test_scan_hands_datasets_the_columns_it_would_build(rows):
    """The scan passes its columns to datasets as one typed Arrow table: the values of datasets' own
    inference from the encoder's lists, and its types where it could infer one (not from empty lists)."""
    import datasets

    from hf_sanity.measure.context import Context
    from hf_sanity.measure.formats import detect_format

    tok = build_tokenizer("chatml")
    data = datasets.Dataset.from_list(rows)
    fmt = detect_format(data.column_names, None)
    ctx = Context(tokenizer=tok, dataset=data, fmt=fmt, options=EncodeOptions(fmt=fmt))
    plain = data.map(ctx.encoder, batched=True, batch_size=16, remove_columns=data.column_names)
    assert ctx.encoded.to_list() == plain.to_list()
    ours, theirs = ctx.encoded.data.schema, plain.data.schema
    assert ours.names == theirs.names
    for name in ours.names:
        if "null" not in str(theirs.field(name).type):
            assert ours.field(name).type == theirs.field(name).type, name


def test_list_column_first_filled_after_the_first_batch():
    """A stray marker first seen after the first 256 rows: datasets alone would have typed the column from
    the first batch (all empty: list<null>) and failed to write it."""
    from helpers import run
    from hf_sanity.testing import synthetic_conversations

    rows = synthetic_conversations(300)
    rows[280]["messages"][-2]["content"] += " <|im_start|> stray"
    report = run(build_tokenizer("chatml"), rows, select=["stray-template-markers"])
    assert [f.rule for f in report.findings] == ["stray-template-markers"]
