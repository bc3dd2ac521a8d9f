"""Full fine-tuning with `transformers.Trainer` (every weight trains), checked by hf-sanity.

Top to bottom:
  1. load the model, its tokenizer and a conversation dataset (a `messages` column);
  2. tokenize with the chat template, loss on the assistant turns only;
  3. preflight the conversations and the exact batches before a single step (stop on errors);
  4. train with `SanityCallback` watching every step (and, with `--generate-every N`, the output checks on a
     few held-out prompts at each evaluation); save the model and tokenizer together, so inference renders
     conversations with the very template training used;
  5. reload the saved model as a server would and check what it says for held-out prompts: it must stop,
     not echo the prompt and write no template markers.

Run it:
    python recipes/full_finetune.py               # the embedded tiny model and demo data, on CPU, in seconds
    python recipes/full_finetune.py --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset train.jsonl \\
        --max-len 2048 --max-steps 1000 --lr 2e-5 --bf16 --output-dir out/smollm-full

On the embedded tiny model the default 60 steps do not teach it to end its answers: step 5 reports so
(never-stops) and the recipe exits 1. `--max-steps 250 --batch-size 32 --lr 3e-3` trains it to answer and stop.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import hf_sanity


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model folder or hub id (default: the embedded tiny model)")
    parser.add_argument("--dataset", help="JSONL or hub id with a `messages` column (default: demo data)")
    parser.add_argument("--output-dir", default="out/full_finetune")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="output check: tokens per answer")
    parser.add_argument(
        "--generate-every",
        type=int,
        default=None,
        help="also check the outputs at evaluations from this step on",
    )
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--force", action="store_true", help="train even when preflight finds errors")
    return parser.parse_args(argv)


def encode_fn(tokenizer, max_len):
    """Chat template for the text; loss on the assistant turns only, EOS/end-of-turn included."""

    def render(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    def count(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(row):
        messages = row["messages"]
        ids = tokenizer(render(messages), add_special_tokens=False)["input_ids"]
        labels = [-100] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                start = count(render(messages[:i], add_generation_prompt=True))
                end = count(render(messages[: i + 1]))
                labels[start:end] = ids[start:end]
        return {"input_ids": ids[:max_len], "labels": labels[:max_len]}

    return encode


def collate_fn(pad_id):
    """Right padding; padding masked by position, never by token id (pad == EOS cannot mask EOS)."""

    def collate(rows):
        width = max(len(r["input_ids"]) for r in rows)
        batch = {"input_ids": [], "labels": [], "attention_mask": []}
        for r in rows:
            pad = width - len(r["input_ids"])
            batch["input_ids"].append(r["input_ids"] + [pad_id] * pad)
            batch["labels"].append(r["labels"] + [-100] * pad)
            batch["attention_mask"].append([1] * len(r["input_ids"]) + [0] * pad)
        return {k: torch.tensor(v) for k, v in batch.items()}

    return collate


def main(argv=None):
    args = parse_args(argv)
    if args.model is None:
        from hf_sanity.testing import tiny_model_dir

        args.model = str(tiny_model_dir("llama3", "distinct"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    if args.dataset is None:
        from hf_sanity.testing import demo_conversations, held_out_conversations

        rows = datasets.Dataset.from_list(demo_conversations(64))
        held_out = datasets.Dataset.from_list(held_out_conversations(16))  # conversations not trained on
    else:
        if Path(args.dataset).suffix in (".json", ".jsonl", ".parquet"):
            builder = "parquet" if args.dataset.endswith(".parquet") else "json"
            data = datasets.load_dataset(builder, data_files=args.dataset, split="train")
        else:
            data = datasets.load_dataset(args.dataset, split="train")
        split = data.train_test_split(test_size=0.1, seed=0)
        rows, held_out = split["train"], split["test"]

    # encode_fn below puts the loss on the assistant turns: say so (TRL's default for messages is every token)
    report = hf_sanity.preflight(
        model=model, tokenizer=tokenizer, dataset=rows, max_len=args.max_len, loss_on="completion"
    )
    report.print()
    if report.has_errors and not args.force:
        sys.exit("preflight found errors (see above); fix them or pass --force")

    train = rows.map(encode_fn(tokenizer, args.max_len), remove_columns=rows.column_names)
    evaluation = held_out.map(encode_fn(tokenizer, args.max_len), remove_columns=held_out.column_names)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # With --generate-every N: at evaluations from step N on, generate for 8 held-out prompts and run the
    # output checks, so a run whose model will never stop is caught at its first such evaluation.
    sanity = hf_sanity.SanityCallback(abort_on="error", generate_every=args.generate_every)
    every = args.generate_every or max(1, args.max_steps // 4)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            weight_decay=0.01,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.max_steps // 20),
            logging_steps=max(1, args.max_steps // 20),
            eval_strategy="steps",
            eval_steps=every,
            save_strategy="no",
            bf16=args.bf16,
            report_to=[],
            seed=0,
        ),
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate_fn(pad_id),
        processing_class=tokenizer,
        callbacks=[sanity],
    )
    batches = hf_sanity.preflight(trainer=trainer)
    batches.print()
    if batches.has_errors and not args.force:
        sys.exit("preflight on the batches found errors (see above); fix them or pass --force")

    trainer.train()
    final = Path(args.output_dir) / "final"
    trainer.save_model(final)  # the tokenizer (and its chat template) travels with it

    # 5. What the saved model says, reloaded as a server would, for held-out prompts.
    said = hf_sanity.outputs(
        model=AutoModelForCausalLM.from_pretrained(final, dtype=model.dtype),
        tokenizer=AutoTokenizer.from_pretrained(final),
        dataset=held_out,
        max_new_tokens=args.max_new_tokens,
    )
    said.print()
    said.write_json(Path(args.output_dir) / "hf-sanity" / "outputs.json")
    print(f"\nmodel: {final}\ntraining report: {Path(args.output_dir) / 'hf-sanity'}")
    return 1 if sanity.report.has_errors or said.has_errors else 0


if __name__ == "__main__":
    sys.exit(main())
