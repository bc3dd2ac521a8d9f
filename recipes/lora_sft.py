"""LoRA supervised fine-tuning with `transformers.Trainer`, checked by hf-sanity at every stage.

Top to bottom:
  1. load the model, its tokenizer and a conversation dataset (a `messages` column);
  2. tokenize with the chat template; labels on the assistant turns only, found by rendering each turn's
     prompt with the generation prompt (what inference will send);
  3. preflight the data, masks, lengths, template and model before a single step, then the exact batches
     the Trainer will feed (stop on errors);
  4. attach LoRA and train with `SanityCallback` watching every step;
  5. save the adapter, merge it, reload the merged model the way a server would, and check that what is
     served computes what was trained, with the same chat template;
  6. check what the served model says: held-out prompts rendered with its chat template, generated greedily,
     compared with the base model's answers (it must stop, not echo the prompt, write no template markers,
     and answer differently from the base model).

Run it:
    python recipes/lora_sft.py                    # a tiny chat model and demo data, on CPU, in seconds
    python recipes/lora_sft.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl \\
        --max-len 2048 --max-steps 1000 --lr 2e-4 --bf16 --output-dir out/qwen-lora

With no --model, the base is a tiny ChatML model already fine-tuned to answer and stop
(`hf_sanity.testing.trained_model_dir("clean")`, built once in about 15 s on a CPU, then cached), as a
real run starts from an instruct model; with no --dataset, LoRA teaches it a new answer style: every answer
opens with "Sure.". Copy it and edit it: nothing here is hidden in a framework.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import datasets
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

import hf_sanity


def parse_args(argv=None):
    # The defaults train the tiny default model; a real run passes its own (see "Run it" above).
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model folder or hub id (default: a tiny chat model, see above)")
    parser.add_argument(
        "--dataset", help="JSON/JSONL/Parquet file or hub id with a `messages` column (default: demo data)"
    )
    parser.add_argument("--output-dir", default="out/lora_sft")
    parser.add_argument("--max-len", type=int, default=512)
    # 200 steps at 1e-2: the tiny default then shows the new style on 11 or 12 of 12 held-out prompts (at 2e-2:
    # 8 to 12 after 100 steps, 9 to 12 after 200), in about 20 s of CPU. Longer runs nearly memorise the demo
    # rows, and an isolated late gradient spike (which the callback reports as info: the clip bounds it) becomes likelier.
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--lora-target", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="output check: tokens per answer")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--force", action="store_true", help="train even when preflight finds errors")
    return parser.parse_args(argv)


def load(args):
    if args.model is None:
        from hf_sanity.testing import trained_model_dir

        args.model = str(trained_model_dir("clean"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    if args.dataset is None:
        from hf_sanity.testing import demo_conversations

        def sure(message):  # the new style: every answer opens with "Sure."
            if message["role"] != "assistant":
                return message
            return {**message, "content": f"Sure. {message['content']}"}

        rows = [{"messages": [sure(m) for m in row["messages"]]} for row in demo_conversations(256)]
        data = datasets.Dataset.from_list(rows)
    elif Path(args.dataset).suffix in (".json", ".jsonl", ".parquet"):
        builder = "parquet" if args.dataset.endswith(".parquet") else "json"
        data = datasets.load_dataset(builder, data_files=args.dataset, split="train")
    else:
        data = datasets.load_dataset(args.dataset, split="train")
    split = data.train_test_split(test_size=0.1, seed=0)
    return model, tokenizer, split["train"], split["test"]


def tokenize(tokenizer, max_len):
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


def collate(pad_id):
    """Right padding; padding masked by position (never by token id, so pad == EOS cannot mask EOS)."""

    def collate_fn(rows):
        width = max(len(r["input_ids"]) for r in rows)
        batch = {"input_ids": [], "labels": [], "attention_mask": []}
        for r in rows:
            pad = width - len(r["input_ids"])
            batch["input_ids"].append(r["input_ids"] + [pad_id] * pad)
            batch["labels"].append(r["labels"] + [-100] * pad)
            batch["attention_mask"].append([1] * len(r["input_ids"]) + [0] * pad)
        return {k: torch.tensor(v) for k, v in batch.items()}

    return collate_fn


def stop_on_errors(report, args, what):
    report.print()
    if report.has_errors and not args.force:
        sys.exit(f"{what} found errors (see above); fix them or pass --force")


def main(argv=None):
    args = parse_args(argv)
    # The LoRA weights are drawn before the Trainer seeds the run, and torch seeds each process differently:
    # without this, two runs of the same command train different adapters.
    set_seed(0)
    out = Path(args.output_dir)
    model, tokenizer, train_rows, eval_rows = load(args)

    # 3a. Preflight on the conversations, before anything is trained.
    stop_on_errors(
        hf_sanity.preflight(  # `tokenize` below puts the loss on the answers (TRL's default: every token)
            model=model,
            tokenizer=tokenizer,
            dataset=train_rows,
            eval_dataset=eval_rows,
            max_len=args.max_len,
            loss_on="completion",
        ),
        args,
        "preflight",
    )

    columns = train_rows.column_names
    train = train_rows.map(tokenize(tokenizer, args.max_len), remove_columns=columns)
    evaluation = eval_rows.map(tokenize(tokenizer, args.max_len), remove_columns=columns)

    # 4. LoRA, and a Trainer watched by SanityCallback.
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=0.05,
        target_modules=args.lora_target.split(","),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sanity = hf_sanity.SanityCallback(abort_on="error")  # stops the run cleanly at the first error finding
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(out),
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.max_steps // 20),
            logging_steps=max(1, args.max_steps // 20),
            eval_strategy="steps",
            eval_steps=max(1, args.max_steps // 4),
            save_strategy="no",
            bf16=args.bf16,
            report_to=[],
            seed=0,
        ),
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate(pad_id),
        processing_class=tokenizer,
        callbacks=[sanity],
    )

    # 3b. Preflight on the exact batches the Trainer will feed, after the collator.
    stop_on_errors(hf_sanity.preflight(trainer=trainer), args, "preflight on the batches")
    trainer.train()

    # 5. Save, merge, reload as a server would, and check that what is served is what was trained: the base
    #    with the saved adapter against the merged model, and the chat template it is served with.
    model.save_pretrained(out / "adapter")
    merged = model.merge_and_unload()
    merged.save_pretrained(out / "merged")
    tokenizer.save_pretrained(out / "merged")
    served = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=merged.dtype)
    served_tokenizer = AutoTokenizer.from_pretrained(out / "merged")
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=merged.dtype)
    serving = hf_sanity.Report(title="hf-sanity serving check")
    serving.extend(
        hf_sanity.served(served, base=base, adapter=str(out / "adapter"), tokenizer=tokenizer).findings
    )
    serving.extend(
        hf_sanity.preflight(
            tokenizer=tokenizer,
            dataset=eval_rows,
            inference_tokenizer=served_tokenizer,
            max_len=args.max_len,
            select=["template-mismatch", "generation-prompt-mismatch"],
        ).findings
    )
    serving.print()

    # 6. What the served model says for held-out prompts, against the base model's answers.
    said = hf_sanity.outputs(
        model=served,
        tokenizer=served_tokenizer,
        dataset=eval_rows,
        base=base,
        max_new_tokens=args.max_new_tokens,
    )
    said.print()
    said.write_json(out / "hf-sanity" / "outputs.json")
    print(
        f"\nadapter: {out / 'adapter'}\nmerged model: {out / 'merged'}\ntraining report: {out / 'hf-sanity'}"
    )
    return 1 if serving.has_errors or sanity.report.has_errors or said.has_errors else 0


if __name__ == "__main__":
    sys.exit(main())
