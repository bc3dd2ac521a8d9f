"""DPO with TRL's `DPOTrainer` and a LoRA adapter, after SFT, checked by hf-sanity before, during and after.

Top to bottom:
  1. load the SFT model, its tokenizer and preference pairs (`prompt`/`chosen`/`rejected`, conversational:
     message lists, as TRL expects);
  2. build the DPOTrainer with a LoRA config: the reference is the same model with the adapter switched off;
  3. preflight the pairs as the trainer prepared them (identical after `max_length`, separable by length, a
     prompt rendered twice, the reference not the policy): stop on errors;
  4. train with `SanityCallback` reading TRL's own metrics (a loss stuck at ln 2, step-0 rewards that are not 0,
     the chosen answers' likelihood falling), then save the adapter;
  5. check what the tuned model says for held-out prompts against the same model with its adapter off: it must
     still answer and stop, and not drift (much longer answers, fewer stops, loops).

Run it:
    python recipes/dpo.py                     # the embedded tiny SFT model and demo pairs, on CPU, in seconds
    python recipes/dpo.py --model ./my-sft-model --dataset pairs.jsonl --max-len 1024 --max-steps 500 \\
        --lr 5e-6 --beta 0.1 --bf16 --output-dir out/dpo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import datasets
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import DPOConfig, DPOTrainer

import hf_sanity


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="SFT model folder or hub id (default: the embedded tiny SFT model)")
    parser.add_argument("--dataset", help="preference JSONL (prompt/chosen/rejected) (default: demo pairs)")
    parser.add_argument("--output-dir", default="out/dpo")
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="output check: tokens per answer")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--force", action="store_true", help="train even when preflight finds errors")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # The LoRA weights are random and torch seeds each process differently: TRL 1.16 seeds the run before it
    # builds the adapter from peft_config, TRL 0.24 (the oldest supported) after. Seeded here for both.
    set_seed(0)
    if args.model is None:  # a tiny model already fine-tuned on the demo chats: it answers and stops
        from hf_sanity.testing import trained_model_dir

        args.model = str(trained_model_dir("clean"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    if args.dataset is None:
        from hf_sanity.testing import demo_preference_pairs

        pairs = datasets.Dataset.from_list(demo_preference_pairs(96, seed=5))
    else:
        pairs = datasets.load_dataset("json", data_files=args.dataset, split="train")
    split = pairs.train_test_split(test_size=0.1, seed=0)
    pairs, held_out = split["train"], split["test"]  # held-out prompts for the output check

    sanity = hf_sanity.SanityCallback(abort_on="error")
    trainer = DPOTrainer(
        model=model,
        args=DPOConfig(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            beta=args.beta,
            lr_scheduler_type="cosine",
            warmup_steps=max(1, args.max_steps // 10),
            logging_steps=max(1, args.max_steps // 10),
            max_length=args.max_len,
            save_strategy="no",
            bf16=args.bf16,
            gradient_checkpointing=False,
            report_to=[],
            seed=0,
        ),
        train_dataset=pairs,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear"),
        callbacks=[sanity],
    )

    # 3. The pairs as the trainer prepared them, cut as its collator will cut them.
    report = hf_sanity.preflight(trainer=trainer)
    report.print()
    if report.has_errors and not args.force:
        sys.exit("preflight found errors (see above); fix them or pass --force")

    trainer.train()
    trainer.model.save_pretrained(Path(args.output_dir) / "adapter")

    # 5. What the tuned model says; its base is the same model with the adapter off (the DPO reference).
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
