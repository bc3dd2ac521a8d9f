"""Vision-language supervised fine-tuning with TRL's `SFTTrainer`, checked by hf-sanity before and during training.

Top to bottom:
  1. load the vision-language model and its processor (the image processor and the tokenizer together);
  2. load the rows: TRL's conversational prompt-completion VLM data (`prompt` is the user turn with its
     `{"type": "image"}` parts, `completion` the answer, `images` the pictures). With prompt-completion rows TRL
     puts the loss on the completion only, so neither the question nor the image placeholders train; with
     `messages` rows TRL's default trains every token, the placeholders included (`vision-tokens-in-loss`);
  3. build the SFTTrainer; TRL's vision-language collator renders each row with the processor's chat template,
     expands every picture into its placeholders and cuts at `max_length`;
  4. preflight the exact batches the trainer will feed and every row's image span against `max_length`
     (stop on errors: a row whose placeholders `max_length` cuts crashes the run when its batch comes up);
  5. train with `SanityCallback` watching every step, then save the model with its processor beside it (what a
     server needs to turn pictures into the same tokens).

Run it:
    python recipes/vlm_sft.py                     # a tiny LLaVA built offline and its own pictures, CPU, seconds
    python recipes/vlm_sft.py --model llava-hf/llava-interleave-qwen-0.5b-hf --dataset rows.jsonl \\
        --max-len 2048 --max-steps 1000 --lr 2e-5 --bf16 --output-dir out/vlm-sft

With no --model, the model is the tiny LLaVA of `hf_sanity.testing.vlm` (a 1-layer CLIP vision tower and a
2-layer Qwen2 text model on the real Qwen2.5 tokenizer with `<image>` added, random weights: built from its
configs once, then cached); with no --dataset, 64 prompt-completion rows with small generated pictures. A
--dataset JSONL holds the same columns, `images` as file paths relative to the file. Copy it and edit it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import datasets
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import SFTConfig, SFTTrainer

import hf_sanity


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="VLM folder or hub id with its processor (default: a tiny LLaVA)")
    parser.add_argument("--dataset", help="JSONL of prompt/completion/images rows (default: generated rows)")
    parser.add_argument("--output-dir", default="out/vlm_sft")
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--force", action="store_true", help="train even when preflight finds errors")
    return parser.parse_args(argv)


def load(args):
    if args.model is None:
        from hf_sanity.testing import vlm

        args.model = str(vlm.tiny_llava_dir())
    processor = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(
        args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32
    )
    if args.dataset is None:
        from hf_sanity.testing import vlm

        return model, processor, vlm.vlm_prompt_completion(64)
    folder = Path(args.dataset).parent
    rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
    for row in rows:  # picture paths are relative to the data file; TRL's collator takes PIL images
        row["images"] = [Image.open(folder / path).convert("RGB") for path in row["images"]]
    return model, processor, datasets.Dataset.from_list(rows)


def stop_on_errors(report, args, what):
    report.print()
    if report.has_errors and not args.force:
        sys.exit(f"{what} found errors (see above); fix them or pass --force")


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.output_dir)
    model, processor, rows = load(args)

    # 3. The trainer: TRL's defaults for prompt-completion rows (completion-only loss), cut at max_length.
    sanity = hf_sanity.SanityCallback(abort_on="error")  # stops the run cleanly at the first error finding
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(
            output_dir=str(out),
            max_length=args.max_len,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            logging_steps=1,
            save_strategy="no",
            bf16=args.bf16,
            use_cpu=not torch.cuda.is_available(),
            report_to=[],
            seed=0,
        ),
        train_dataset=rows,
        processing_class=processor,
        callbacks=[sanity],
    )

    # 4. Preflight on the exact batches the trainer will feed, and every row's image span against max_length.
    stop_on_errors(hf_sanity.preflight(trainer=trainer), args, "preflight")
    trainer.train()

    # 5. The model and its processor (image processor config, chat template) saved together, as a server loads.
    trainer.save_model(str(out / "final"))
    processor.save_pretrained(out / "final")
    sanity.report.print()
    print(f"\nmodel and processor: {out / 'final'}\ntraining report: {out / 'hf-sanity'}")
    return 1 if sanity.report.has_errors else 0


if __name__ == "__main__":
    sys.exit(main())
