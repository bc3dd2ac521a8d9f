"""`make bench`: every benchmark of hf-sanity, printed as tables (figures go to docs/benchmarks.md).

python -m benchmarks.run [--quick] [--only preflight|model|callback|overfit|outputs|preference|rl|moe|agents|vlm|launch]
"""

from __future__ import annotations

import argparse
import os
import platform

from benchmarks.tables import table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {gpu}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one repeat (a smoke run)")
    parser.add_argument(
        "--only",
        choices=[
            "preflight",
            "model",
            "callback",
            "overfit",
            "outputs",
            "preference",
            "rl",
            "moe",
            "agents",
            "vlm",
            "launch",
        ],
        default=None,
    )
    args = parser.parse_args()
    print(f"machine: {machine()}\n")
    if args.only in (None, "preflight"):
        from benchmarks import preflight_speed
        from hf_sanity.testing import build_tokenizer

        tokenizers = [("tiny-chatml", build_tokenizer("chatml"))]
        real = os.path.join(
            os.path.dirname(__file__), "..", "..", "shared", "real-tokenizers", "qwen2.5-instruct"
        )
        if os.path.isdir(real):
            from transformers import AutoTokenizer

            tokenizers.append(("qwen2.5", AutoTokenizer.from_pretrained(real)))
        sizes = (200, 2_000) if args.quick else (2_000, 20_000)
        rows = []
        for label, tok in tokenizers:
            rows += preflight_speed.run(tok, sizes=sizes, repeats=1 if args.quick else 3, label=label)
        print("preflight scan vs bare chat-template tokenization (median of repeats, seconds)")
        print(table(rows), "\n")
    if args.only in (None, "model"):
        from benchmarks import preflight_model

        rows = preflight_model.run(quick=args.quick)
        print(
            "preflight with the model checks (defaults) vs data-only preflight and vs a bare map (Qwen2.5 tokenizer)"
        )
        print(table(rows), "\n")
    if args.only in (None, "callback"):
        from benchmarks import callback_overhead

        rows, clocks = callback_overhead.run(quick=args.quick)
        print("SanityCallback overhead: whole train() wall time and median step time, with and without it")
        print(table(rows), "\n")
        print("SanityCallback's own clock: microseconds per step by hook, seconds per run by check")
        for clock in clocks:
            print(clock["model"], "| hooks total", clock["hooks_ms_per_step_total"], "ms/step")
            print("  ", clock["hooks_us_per_step"])
            top = sorted(clock["top_checks_s_per_run"].items(), key=lambda kv: -kv[1])[:8]
            print("  ", dict(top))
        print()
        row = callback_overhead.feed_growth(steps=2_000 if args.quick else 20_000)
        print("SanityCallback's per-step work at the reads, early and late in a long run (no Trainer)")
        print(table([row]), "\n")
    if args.only in (None, "rl"):
        from benchmarks import rl_overhead

        compared, preflight = rl_overhead.run(quick=args.quick)
        print("SanityCallback on a GRPO run: whole train() wall time with and without it")
        print(table(compared), "\n")
        print("preflight(trainer=GRPOTrainer): the model's own completions and the reward dry run")
        print(table([preflight]), "\n")
    if args.only in (None, "moe"):
        from benchmarks import moe_overhead

        row = moe_overhead.run(quick=args.quick)
        print("SanityCallback on a mixture-of-experts SFT run: the router probe against the run's wall time")
        print(table([row]), "\n")
        from benchmarks import rl_overhead

        sampler = rl_overhead.sampler_probe_cost(steps=40 if args.quick else 200)
        print(
            "SanityCallback on a GRPO run with a rollout_func: the rescoring probe against the run's wall time"
        )
        print(table([sampler]), "\n")
        together = float(row["probe_forwards_share"].rstrip("%")) / 100 + sampler["probe_share"]
        print("The router probe (with the probe forwards it rides on) and the rescoring probe together")
        print(table([{"router_and_rescoring_share": f"{together:.3%}", "target": "<= 1%"}]), "\n")
    if args.only in (None, "agents"):
        from benchmarks import agents_speed

        print("preflight's agent and reasoning rules against the scan (encoding) on tool conversations")
        print(table([agents_speed.run(quick=args.quick)]), "\n")
    if args.only in (None, "launch"):
        from benchmarks import launch_overhead

        attached, checked = launch_overhead.run(quick=args.quick)
        print("hf-sanity run -- python train.py vs the callback attached in the script (whole-process wall)")
        print(table([attached]), "\n")
        print(
            "hf-sanity preflight -- python train.py vs the command's start-up + in-process preflight(trainer=)"
        )
        print(table([checked]), "\n")
    if args.only in (None, "vlm"):
        from benchmarks import vlm_speed

        print("preflight(trainer=SFTTrainer) on vision-language rows vs the trainer's own collation of them")
        print(table(vlm_speed.run(quick=args.quick)), "\n")
    if args.only in (None, "overfit"):
        from benchmarks import protocol_speed

        rows = protocol_speed.run(quick=args.quick)
        print("hf-sanity overfit vs a bare PyTorch loop over the same batches (one CPU thread each)")
        print(table(rows), "\n")
    if args.only in (None, "outputs"):
        from benchmarks import outputs_speed

        rows = outputs_speed.speed(repeats=1 if args.quick else 3)
        print("hf-sanity outputs: greedy generation, 32 prompts x 256 new tokens, batched vs one at a time")
        print(table(rows), "\n")
        rows = outputs_speed.calibration(seeds=(0,) if args.quick else (0, 1, 2))
        print("hf-sanity outputs: share of generations each rule judges faulty (clean vs planted fixtures)")
        print(table(rows), "\n")
    if args.only in (None, "preference"):
        from benchmarks import preference_speed

        rows = preference_speed.preparation(
            sizes=(200,) if args.quick else (500, 2_000), repeats=1 if args.quick else 3
        )
        print("preflight(trainer=DPOTrainer) vs the trainer's own preparation of the same pairs (seconds)")
        print(table(rows), "\n")
        rows = [
            row
            for steps in ((10,) if args.quick else (40, 160))  # a short run, and issue 29's 160-step row
            for row in preference_speed.callback(steps=steps, pairs=2 if args.quick else 8)
        ]
        print("SanityCallback on a DPO run: whole train() wall time with and without it (ABBA pairs)")
        print(table(rows), "\n")


if __name__ == "__main__":
    main()
