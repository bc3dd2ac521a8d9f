"""GRPO with TRL's `GRPOTrainer` and reward functions, after SFT, checked by hf-sanity before, during and after.

Top to bottom:
  1. load the SFT model, its tokenizer and prompts (`prompt` as a conversation, as TRL expects, with the
     reference `answer` the reward functions read: TRL passes every column to them by name);
  2. write the reward functions the way TRL calls them: a conversational prompt's completion is a list of
     messages, so its text is `completion[0]["content"]`;
  3. build the GRPOTrainer (G completions per prompt, `max_completion_length`, the sampling temperature);
  4. preflight it: every reward function called on completions of the exact shape TRL passes (a broken one, one
     that scores messages as strings, a missing column, a constant), the model's own completions generated with
     the trainer's settings (cut at `max_completion_length`? ending on a token the trainer stops on?), groups
     too small for a binary reward: stop on errors;
  5. train with `SanityCallback` reading TRL's metrics and rollouts (groups with one reward and why, truncation,
     the KL to the start, entropy, a reward gamed at another's expense), then save the model;
  6. check what the tuned model says for held-out prompts against the model it started from, with the reward
     functions scored on the held-out answers: it must still answer and stop, not drift, and keep its reward.

Run it:
    python recipes/grpo.py                     # the embedded tiny SFT model and demo prompts, on CPU, in seconds
    python recipes/grpo.py --model ./my-sft-model --dataset prompts.jsonl --num-generations 8 \\
        --max-completion-length 512 --max-steps 500 --lr 1e-6 --bf16 --output-dir out/grpo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

import hf_sanity


def text_of(completion) -> str:
    """A completion as TRL passes it: a string for a text prompt, a list of messages for a conversational one."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def correct(completions, answer, **kwargs) -> list[float]:
    """1 when the completion ends with the reference answer's last word ("... is Paris." -> "Paris")."""
    return [float(a.split()[-1].rstrip(".") in text_of(c)) for c, a in zip(completions, answer)]


def concise(completions, **kwargs) -> list[float]:
    """Prefers answers of about one sentence (30 characters)."""
    return [-abs(len(text_of(c)) - 30) / 30 for c in completions]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="SFT model folder or hub id (default: the embedded tiny SFT model)")
    parser.add_argument("--dataset", help="JSONL of prompt/answer rows (default: demo prompts)")
    parser.add_argument("--output-dir", default="out/grpo")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.2)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--beta", type=float, default=0.0, help="KL penalty to the reference (0: TRL's default)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="output check: tokens per answer")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--no-reward-dry-run", action="store_true", help="reward functions call a paid service"
    )
    parser.add_argument("--force", action="store_true", help="train even when preflight finds errors")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.model is None:  # a tiny model already fine-tuned on the demo chats: it answers and stops
        from hf_sanity.testing import trained_model_dir

        args.model = str(trained_model_dir("clean"))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    if args.dataset is None:
        from hf_sanity.testing import demo_rl_prompts

        prompts = datasets.Dataset.from_list(demo_rl_prompts(96, seed=5))
    else:
        prompts = datasets.load_dataset("json", data_files=args.dataset, split="train")
    split = prompts.train_test_split(test_size=0.1, seed=0)
    prompts, held_out = split["train"], split["test"]  # held-out prompts for the output check

    sanity = hf_sanity.SanityCallback(abort_on="error", reward_dry_run=not args.no_reward_dry_run)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correct, concise],
        args=GRPOConfig(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            learning_rate=args.lr,
            beta=args.beta,
            logging_steps=1,
            save_strategy="no",
            bf16=args.bf16,
            gradient_checkpointing=False,
            report_to=[],
            seed=0,
        ),
        train_dataset=prompts,
        processing_class=tokenizer,
        callbacks=[sanity],
    )

    # 4. The reward functions and the model's own completions, before the first step.
    report = hf_sanity.preflight(trainer=trainer, reward_dry_run=not args.no_reward_dry_run)
    report.print()
    if report.has_errors and not args.force:
        sys.exit("preflight found errors (see above); fix them or pass --force")

    trainer.train()
    trainer.save_model(Path(args.output_dir) / "model")

    # 6. What the tuned model says, against the model it started from, and its reward on the held-out prompts
    #    against the reward of its last training steps (read from the run's log).
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    said = hf_sanity.outputs(
        model=trainer.model,
        tokenizer=tokenizer,
        dataset=held_out,
        base=base,
        objective="rl",
        reward_funcs=[correct, concise],
        train_reward=trainer.state.log_history,
        max_new_tokens=args.max_new_tokens,
    )
    said.print()
    said.write_json(Path(args.output_dir) / "hf-sanity" / "outputs.json")
    print(
        f"\nmodel: {Path(args.output_dir) / 'model'}\ntraining report: {Path(args.output_dir) / 'hf-sanity'}"
    )
    return 1 if sanity.report.has_errors or said.has_errors else 0


if __name__ == "__main__":
    sys.exit(main())
