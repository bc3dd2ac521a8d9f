"""`hf-sanity demo`: what the tool does, on the embedded tiny model, offline, in under a minute.

It runs the checks on a correct fine-tuning setup and on a broken one (prompt tokens in the loss, EOS
masked by a pad == EOS collator, answers truncated by max_len) and prints both reports.
"""

from __future__ import annotations

from rich.console import Console
from rich.rule import Rule

from hf_sanity.tokenview import IGNORE_INDEX


def broken_pipeline_rows(tokenizer, conversations) -> list[dict]:
    """What a typical buggy preprocessing produces: the whole conversation as labels (prompt included),
    and EOS masked because pad == EOS and the collator masks pad ids."""
    rows = []
    for row in conversations:
        ids = tokenizer.apply_chat_template(row["messages"])["input_ids"]
        labels = [IGNORE_INDEX if i == tokenizer.pad_token_id else i for i in ids]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def run_demo(console: Console | None = None) -> int:
    import datasets

    from hf_sanity.preflight import preflight
    from hf_sanity.testing import build_tokenizer, demo_conversations, tiny_model_dir
    from hf_sanity.testing.factory import tiny_setup

    console = console or Console()
    conversations = demo_conversations(64)
    data = datasets.Dataset.from_list(conversations)

    console.print(Rule("1. preflight on a correct setup"))
    console.print(
        "ChatML tokenizer, pad distinct from EOS, loss on completions only, max_len=128\n", style="dim"
    )
    folder = tiny_model_dir("chatml", "distinct")
    model, tokenizer = tiny_setup("chatml", "distinct")
    clean = preflight(model=model, tokenizer=tokenizer, dataset=data, max_len=128, use_config=False)
    console.print(clean)

    console.print(Rule("2. preflight on a broken setup"))
    console.print(
        "the same data pre-tokenized by a buggy pipeline: labels = input_ids (prompt in the loss), pad == EOS "
        "masked by the collator, max_len=40\n",
        style="dim",
    )
    broken_tokenizer = build_tokenizer("chatml", "eos")
    broken_rows = broken_pipeline_rows(broken_tokenizer, conversations)
    broken = preflight(
        model=model,
        tokenizer=broken_tokenizer,
        dataset=datasets.Dataset.from_list(broken_rows),
        max_len=40,
        use_config=False,
    )
    console.print(broken)

    from hf_sanity.protocol import demo_diagnose

    diagnosis = demo_diagnose(console)
    named = diagnosis.stats.get("broken_layer")
    console.print(Rule())
    console.print(f"tiny model: {folder}", style="dim")
    ok = not clean.has_errors and broken.has_errors and diagnosis.has_errors and bool(named)
    console.print(
        f"demo: the correct setup is clean, the broken one is caught, and diagnose names the broken layer ({named})"
        if ok
        else "demo: unexpected result",
        style="bold green" if ok else "bold red",
        soft_wrap=True,
    )
    return 0 if ok else 1
