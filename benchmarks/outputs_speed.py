"""`hf-sanity outputs`: what generation costs, and where the output rules' thresholds sit.

Speed: greedy generation of 32 held-out prompts x 256 new tokens on the tiny model fine-tuned with its end of
turn masked (it never stops, so every prompt runs the full 256 tokens: the worst case), batched with left
padding (one ``generate`` call) against one prompt at a time, median of repeats, one CPU thread (the tiny
model is overhead-bound: more threads only contend).

Calibration: the per-rule shares (the fraction of generations each rule judges faulty) of the correctly
fine-tuned tiny model at three training seeds, on 64 held-out prompts each, against each planted bug's.
"""

from __future__ import annotations

import statistics
import time

import datasets

RULE_SHARES = (
    "never-stops",
    "stray-markers-in-output",
    "repeats-prompt",
    "repetition-loop",
    "answer-truncated",
)
PLANTED = {
    "eos-masked": "never-stops",
    "wrong-template": "stray-markers-in-output",
    "prompt-in-answer": "repeats-prompt",
    "undertrained": "repetition-loop",
    "truncated": "answer-truncated",
}


def speed(repeats: int = 3, prompts: int = 32, max_new_tokens: int = 256) -> list[dict]:
    import torch

    from hf_sanity.measure.generate import generate, held_out_prompts
    from hf_sanity.testing import held_out_conversations, trained_setup

    model, tok = trained_setup("eos-masked")
    rows = held_out_prompts(datasets.Dataset.from_list(held_out_conversations(prompts)), n=prompts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for batch_size in (prompts, 1):
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                gens = generate(model, tok, rows, max_new_tokens=max_new_tokens, batch_size=batch_size)
                times.append(time.perf_counter() - started)
            tokens = sum(len(s.ids) for s in gens.samples)
            median = statistics.median(times)
            out.append(
                {
                    "model": "tiny (0.2M)",
                    "prompts": prompts,
                    "max_new_tokens": max_new_tokens,
                    "batch_size": batch_size,
                    "generated_tokens": tokens,
                    "seconds": median,
                    "tokens_per_s": tokens / median,
                }
            )
    finally:
        torch.set_num_threads(threads)
    return out


def shares(model, tok, rows) -> dict[str, float]:
    """The share of generations each rule judges faulty (its own per-generation test, before its threshold)."""
    from hf_sanity.measure.generate import generate, held_out_prompts
    from hf_sanity.rules import outputs as rules

    gens = generate(model, tok, held_out_prompts(rows, n=len(rows)))
    n = len(gens.samples)
    judged = [s for s in gens.samples if s.reference is not None and rules._ends_sentence(s.reference)]
    return {
        "never-stops": sum(not s.stopped for s in gens.samples) / n,
        "stray-markers-in-output": sum(bool(rules._strays(gens, s)) for s in gens.samples) / n,
        "repeats-prompt": sum(rules.echo_of(s) is not None for s in gens.samples) / n,
        "repetition-loop": sum(rules.loops(s) for s in gens.samples) / n,
        "answer-truncated": sum(rules.truncated(s) for s in judged) / max(len(judged), 1),
    }


def calibration(seeds=(0, 1, 2), prompts: int = 64) -> list[dict]:
    import torch

    from hf_sanity.testing import held_out_conversations, trained_setup

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for seed in seeds:
            model, tok = trained_setup("clean", seed)
            rows = datasets.Dataset.from_list(held_out_conversations(prompts, seed=seed + 1))
            out.append({"model": f"clean (seed {seed})", **shares(model, tok, rows)})
        rows = datasets.Dataset.from_list(held_out_conversations(prompts, seed=1))
        for variant in PLANTED:
            model, tok = trained_setup(variant)
            out.append({"model": f"{variant} (seed 0)", **shares(model, tok, rows)})
    finally:
        torch.set_num_threads(threads)
    from hf_sanity.rules import outputs as rules

    out.append(
        {
            "model": "threshold",
            "never-stops": rules.NEVER_STOPS_SHARE,
            "stray-markers-in-output": rules.STRAY_SHARE,
            "repeats-prompt": rules.ECHO_SHARE,
            "repetition-loop": rules.LOOP_SHARE,
            "answer-truncated": rules.TRUNCATED_SHARE,
        }
    )
    return out
