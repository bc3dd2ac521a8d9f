"""`hf-sanity demo`: what the tool does, on the embedded tiny model, offline, in under a minute.

It runs the checks on a correct fine-tuning setup and on a broken one (prompt tokens in the loss, EOS
masked by a pad == EOS collator, answers truncated by max_len) and prints both reports; then SanityCallback
on a training run whose loss goes NaN, and `diagnose` on a realistic broken setup: the optimizer is created
for the full model, then the LoRA adapter is attached (peft freezes the base weights the optimizer holds and
adds new LoRA weights it does not hold, so training runs, logs a loss, and nothing learns).
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import warnings

from rich.console import Console
from rich.rule import Rule

from hf_sanity.constants import IGNORE_INDEX

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


def broken_setup(workdir: str) -> dict:
    """The keyword arguments of ``diagnose`` for a broken setup: ``{"trainer": Trainer}`` whose optimizer was built
    before the LoRA adapter was attached (it holds the frozen base weights, none of the trainable LoRA ones);
    its output_dir is under ``workdir``."""
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from hf_sanity.measure.encode import EncodeOptions, Encoder
    from hf_sanity.testing import demo_conversations, tiny_setup

    model, tokenizer = tiny_setup("chatml", "distinct")
    encoder = Encoder(tokenizer, EncodeOptions(fmt="messages", loss_on="assistant"))
    rows = [encoder.encode(row) for row in demo_conversations(DEMO_EXAMPLES)]
    train = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the bug: built before the adapter exists
    with warnings.catch_warnings():  # peft reads a deprecated transformers attribute
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
    args = TrainingArguments(
        output_dir=os.path.join(workdir, "diagnosed-run"),
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


def demo_diagnose(console: Console | None = None, workdir: str | None = None):
    """Run `diagnose` on :func:`broken_setup`, print the report and return it (a few seconds on 2 CPU cores).
    What it writes goes under ``workdir`` (default: a temporary folder, removed on return)."""
    from hf_sanity.protocol import diagnose

    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="hf-sanity-demo-") as scratch:
            return demo_diagnose(console, scratch)

    console = console or Console()
    console.print(Rule("diagnose on a broken training setup"))
    console.print(
        "a Trainer whose AdamW was created for the full model before the LoRA adapter was attached\n",
        style="dim",
    )
    with tiny_threads():
        setup = broken_setup(workdir)
        report = diagnose(**setup, repro=os.path.join(workdir, "repro"), with_plot=False)
    console.print(report)
    return report


def broken_pipeline_rows(tokenizer, conversations) -> list[dict]:
    """What a typical buggy preprocessing produces: the whole conversation as labels (prompt included),
    and EOS masked because pad == EOS and the collator masks pad ids."""
    rows = []
    for row in conversations:
        ids = tokenizer.apply_chat_template(row["messages"])["input_ids"]
        labels = [IGNORE_INDEX if i == tokenizer.pad_token_id else i for i in ids]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def watched_broken_run(console: Console, workdir: str):
    """A Trainer run whose hand-written loss takes log(softmax(logits / T)) at a small temperature: softmax
    underflows to 0, 0 * log(0) is NaN, and Trainer logs the step as loss 0.0. SanityCallback names the
    exact step and the cause, and stops the run (its report and the saved batch go under ``workdir``)."""
    import datasets
    import torch
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from hf_sanity.callback import SanityCallback
    from hf_sanity.measure.encode import EncodeOptions, Encoder
    from hf_sanity.testing import demo_conversations, tiny_setup

    class DistillStyleTrainer(Trainer):
        temperature = 1e-4  # the bug: far too sharp

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits[:, :-1]
            target, mask = labels[:, 1:], labels[:, 1:] != -100
            probs = torch.softmax(logits / self.temperature, -1)
            onehot = torch.nn.functional.one_hot(target.clamp(min=0), probs.shape[-1])
            return -(onehot * torch.log(probs)).sum(-1)[mask].mean()

    console.print(Rule("3. SanityCallback on a broken training run"))
    console.print(
        "a hand-written loss, -(onehot * log(softmax(logits / 1e-4))): Trainer logs the NaN steps as loss 0.0\n",
        style="dim",
    )
    model, tokenizer = tiny_setup("chatml", "distinct")
    encoder = Encoder(tokenizer, EncodeOptions(fmt="messages", loss_on="assistant"))
    rows = [encoder.encode(r) for r in demo_conversations(32)]
    train = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    callback = SanityCallback(abort_on="error", use_config=False, print_findings=False)
    trainer = DistillStyleTrainer(
        model=copy.deepcopy(model),
        args=TrainingArguments(
            output_dir=os.path.join(workdir, "watched-run"),
            max_steps=20,
            per_device_train_batch_size=8,
            learning_rate=1e-3,
            logging_steps=5,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        ),
        train_dataset=train,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
        callbacks=[callback],
    )
    trainer.train()
    console.print(callback.report)
    return callback.report


def run_demo(console: Console | None = None) -> int:
    """Every part of the demo, printed on ``console``; 0 when each part shows what it should. What the runs
    write (the callback's report and saved batch, the reproduction) goes to a temporary folder, removed at
    the end."""
    console = console or Console()
    with tempfile.TemporaryDirectory(prefix="hf-sanity-demo-") as workdir:
        code = _run_demo(console, workdir)
    console.print(f"the demo's files were written under {workdir} and removed", style="dim")
    return code


def _run_demo(console: Console, workdir: str) -> int:
    import datasets

    from hf_sanity.drivers.preflight import preflight
    from hf_sanity.testing import build_tokenizer, demo_conversations, tiny_model_dir
    from hf_sanity.testing.factory import tiny_setup

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

    watched = watched_broken_run(console, workdir)

    diagnosis = demo_diagnose(console, workdir)
    named = diagnosis.stats.get("broken_layer")
    console.print(Rule())
    console.print(f"tiny model: {folder}", style="dim")
    caught = [f for f in watched.by_rule("nonfinite-loss") if f.evidence.get("cause") == "unsafe-math"]
    ok = not clean.has_errors and broken.has_errors and bool(caught) and diagnosis.has_errors and bool(named)
    console.print(
        "demo: the correct setup is clean, the broken one is caught, the callback names the NaN step and its cause, "
        f"and diagnose names the broken layer ({named})"
        if ok
        else "demo: unexpected result",
        style="bold green" if ok else "bold red",
        soft_wrap=True,
    )
    return 0 if ok else 1
