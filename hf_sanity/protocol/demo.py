"""The protocol in `hf-sanity demo`: `diagnose` on a realistic broken setup built on the embedded tiny model.

The bug: the optimizer is created for the full model, then the LoRA adapter is attached. peft freezes the base
weights the optimizer holds and adds new LoRA weights it does not hold, so training runs, logs a loss, and
nothing learns. `diagnose` stops at layer 1 and names it: params not in the optimizer.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

from rich.console import Console
from rich.rule import Rule

DEMO_EXAMPLES = 16


@contextlib.contextmanager
def tiny_threads():
    """One intra-op thread while the tiny model runs: its ops are too small to split, threads only add overhead."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def broken_setup() -> dict:
    """The keyword arguments of ``diagnose`` for a broken setup: ``{"trainer": Trainer}`` whose optimizer was built
    before the LoRA adapter was attached (it holds the frozen base weights, none of the trainable LoRA ones)."""
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from hf_sanity.preflight.encode import EncodeOptions, Encoder
    from hf_sanity.testing import demo_conversations, tiny_setup

    model, tokenizer = tiny_setup("chatml", "distinct")
    encoder = Encoder(tokenizer, EncodeOptions(fmt="messages"))
    rows = [encoder.encode(row) for row in demo_conversations(DEMO_EXAMPLES)]
    train = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the bug: built before the adapter exists
    with warnings.catch_warnings():  # peft reads a deprecated transformers attribute
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
    args = TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), "hf-sanity-demo"),
        per_device_train_batch_size=8,
        max_steps=10,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
        optimizers=(optimizer, None),
    )
    return {"trainer": trainer}


def demo_diagnose(console: Console | None = None):
    """Run `diagnose` on :func:`broken_setup`, print the report and return it (a few seconds on 2 CPU cores)."""
    from hf_sanity.protocol.diagnose import diagnose

    console = console or Console()
    console.print(Rule("diagnose on a broken training setup"))
    console.print(
        "a Trainer whose AdamW was created for the full model before the LoRA adapter was attached\n",
        style="dim",
    )
    with tiny_threads():
        setup = broken_setup()
        report = diagnose(**setup, repro=tempfile.mkdtemp(prefix="hf-sanity-repro-"), with_plot=False)
    console.print(report)
    return report
