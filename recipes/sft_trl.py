"""LoRA fine-tuning with TRL's `SFTTrainer` on prompt/completion data (loss on the completions only),
checked by hf-sanity before and during training.

Top to bottom:
  1. load the model, its tokenizer and a prompt/completion dataset (conversational: `prompt` and
     `completion` are message lists, as TRL expects);
  2. build the SFTTrainer with a LoRA config; TRL tokenizes, puts the loss on completions only
     (`completion_only_loss`) and collates;
  3. preflight the exact batches the trainer will feed (stop on errors);
  4. train with `SanityCallback` watching every step, then save the adapter;
  5. check what the trained model says for held-out prompts, with and without its adapter: it must stop, not
     echo the prompt, write no template markers, and answer differently from the base model.

Run it:
    python recipes/sft_trl.py                     # the embedded tiny model and demo data, on CPU, in seconds
    python recipes/sft_trl.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl --max-len 2048 \\
        --max-steps 1000 --lr 2e-4 --bf16 --output-dir out/qwen-sft

On the embedded tiny model (random weights) a few dozen LoRA steps teach no chat format: step 5 reports what
such a model says (by default it answers nearly every held-out prompt with one cut-off sentence, `The capital
of.`: identical-outputs; with fewer steps it never stops or answers empty) and the recipe exits 1; on a real
model and run it is the last gate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import datasets
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import SFTConfig, SFTTrainer

import hf_sanity


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model folder or hub id (default: the embedded tiny model)")
    parser.add_argument("--dataset", help="prompt/completion JSONL or hub id (default: demo data)")
    parser.add_argument("--output-dir", default="out/sft_trl")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="output check: tokens per answer")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--force", action="store_true", help="train even when preflight finds errors")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # The LoRA weights are random and torch seeds each process differently: TRL 1.16 seeds the run before it
    # builds the adapter from peft_config, TRL 0.24 (the oldest supported) after. Seeded here for both.
    set_seed(0)
    if args.model is None:
        from hf_sanity.testing import tiny_model_dir

        args.model = str(tiny_model_dir("chatml", "distinct"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    if args.dataset is None:
        from hf_sanity.testing import as_prompt_completion, demo_conversations

        data = datasets.Dataset.from_list(as_prompt_completion(demo_conversations(64), conversational=True))
    elif Path(args.dataset).suffix in (".json", ".jsonl", ".parquet"):
        builder = "parquet" if args.dataset.endswith(".parquet") else "json"
        data = datasets.load_dataset(builder, data_files=args.dataset, split="train")
    else:
        data = datasets.load_dataset(args.dataset, split="train")
    split = data.train_test_split(test_size=0.1, seed=0)
    data, held_out = split["train"], split["test"]  # held-out prompts for the output check

    sanity = hf_sanity.SanityCallback(abort_on="error")
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.max_steps // 20),
            logging_steps=max(1, args.max_steps // 20),
            max_length=args.max_len,
            completion_only_loss=True,
            save_strategy="no",
            bf16=args.bf16,
            report_to=[],
            seed=0,
        ),
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear"),
        callbacks=[sanity],
    )

    # Preflight on the exact batches: TRL's tokenization, completion mask and collator included.
    report = hf_sanity.preflight(trainer=trainer)
    report.print()
    if report.has_errors and not args.force:
        sys.exit("preflight found errors (see above); fix them or pass --force")

    trainer.train()
    trainer.model.save_pretrained(Path(args.output_dir) / "adapter")

    # 5. What the trained model says for held-out prompts; its base is the same model with the adapter off.
    said = hf_sanity.outputs(
        model=trainer.model,
        tokenizer=tokenizer,
        dataset=held_out,
        base=trainer.model,
        max_new_tokens=args.max_new_tokens,
    )
    said.print()
    said.write_json(Path(args.output_dir) / "hf-sanity" / "outputs.json")
    print(
        f"\nadapter: {Path(args.output_dir) / 'adapter'}\ntraining report: {Path(args.output_dir) / 'hf-sanity'}"
    )
    return 1 if sanity.report.has_errors or said.has_errors else 0


if __name__ == "__main__":
    sys.exit(main())
