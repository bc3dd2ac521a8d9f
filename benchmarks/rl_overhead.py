"""SanityCallback's cost on a GRPO run, and the cost of preflight's RL measurements (the model's own completions
and the reward dry run).

The same ``GRPOTrainer`` run (the tiny model fine-tuned on the demo chats, 64 demo prompts, batch 8, G=4,
``max_completion_length`` 32, a graded reward, 40 steps: issue 29's row) with and without ``SanityCallback()``
(all rules: the reward dry run and the KL probe of beta = 0 included), after one warm-up run, 8 pairs in ABBA
order; the wall clock covers the whole ``trainer.train()`` call. Generation dominates a GRPO step, so the callback's
per-step work weighs little; its one-off work at train begin (the reward dry run) is in its own clock. One CPU
thread on both sides. Twice: logging every step (issue 29's row; the callback reads TRL's metrics and rollouts at
each log) and every 10 (TRL's default ``logging_steps``); each with the callback alone, and after a
``preflight(trainer=...)`` (on both sides), whose dry-run verdict the callback reads instead of forking its own.
"""

from __future__ import annotations

import statistics
import tempfile
import time


def length_reward(completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [-abs(len(t) - 30) / 30 for t in texts]


def trainer(out: str, steps: int, callbacks=(), rollout_func=None, logging_steps: int = 1):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from hf_sanity.testing import demo_rl_prompts, trained_model_dir

    folder = trained_model_dir("clean")
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder),
        reward_funcs=[length_reward],
        args=GRPOConfig(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=32,
            temperature=1.2,
            learning_rate=1e-4,
            logging_steps=logging_steps,
            report_to=[],
            save_strategy="no",
            bf16=False,
            gradient_checkpointing=False,
            seed=0,
            disable_tqdm=True,
        ),
        train_dataset=datasets.Dataset.from_list(demo_rl_prompts(64, seed=3)),
        processing_class=AutoTokenizer.from_pretrained(folder),
        callbacks=list(callbacks),
        rollout_func=rollout_func,
    )


def one_run(steps: int, with_callback: bool, logging_steps: int = 1, preflight: bool = False) -> dict:
    """One run's wall time (``trainer.train()`` only) and the callback's stats; ``preflight``: a
    ``preflight(trainer=...)`` first, on both sides of a pair (its generation warms the same paths for both), whose
    dry run the callback then reads instead of making its own."""
    import hf_sanity
    from hf_sanity import SanityCallback

    callbacks = [SanityCallback(use_config=False, print_findings=False)] if with_callback else []
    with tempfile.TemporaryDirectory() as out:
        run = trainer(out, steps, callbacks, logging_steps=logging_steps)
        if preflight:
            hf_sanity.preflight(trainer=run, use_config=False)
        started = time.perf_counter()
        run.train()
        wall = time.perf_counter() - started
    stats = callbacks[0].report.stats if callbacks else {}
    findings = [f.rule for f in callbacks[0].report.findings] if callbacks else []
    return {
        "wall": wall,
        "share": stats.get("callback_share") or 0.0,  # its own clock over the time since train begin
        "callback_s": stats.get("callback_seconds", 0.0),
        "by_check": stats.get("callback_seconds_by_check", {}),
        "findings": findings,
    }


def compare(steps: int = 40, repeats: int = 8, logging_steps: int = 1, preflight: bool = False) -> dict:
    """``repeats`` pairs of runs with and without the callback, in ABBA order (pair i runs bare first when i is
    even): the median of the per-pair wall ratios with their range, and the callback's own share of each watched
    run (report ``stats.callback_share``: median and range)."""
    one_run(min(steps, 4), True, preflight=preflight)  # warm-up: caches, the first generate's set-up
    pairs, runs = [], []
    for i in range(repeats):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {flag: one_run(steps, flag, logging_steps, preflight) for flag in order}
        pairs.append(got[True]["wall"] / got[False]["wall"])
        runs.append(got)
    without = statistics.median(r[False]["wall"] for r in runs)
    with_cb = statistics.median(r[True]["wall"] for r in runs)
    shares = [r[True]["share"] for r in runs]
    last = runs[-1][True]
    return {
        "model": "GRPO: tiny 0.2M, batch 8, G=4, 32 tokens",
        "steps": steps,
        "logging_steps": logging_steps,
        "preflight_first": "yes" if preflight else "no",
        "pairs": repeats,
        "wall_s_without": without,
        "wall_s_with": with_cb,
        "wall_ratio": statistics.median(pairs),
        "wall_ratio_range": f"{min(pairs):.3f}-{max(pairs):.3f}",
        "callback_s": statistics.median(r[True]["callback_s"] for r in runs),
        "callback_share": statistics.median(shares),  # its own clock against the run's wall time
        "share_range": f"{min(shares):.4f}-{max(shares):.4f}",
        "top_checks_s": ", ".join(f"{k} {v:.3f}" for k, v in list(last["by_check"].items())[:4]),
        "findings": ", ".join(sorted({f for r in runs for f in r[True]["findings"]})) or "none",
    }


def preflight_cost() -> dict:
    """preflight(trainer=...) on the same GRPO setup: the model's own completions (a group for each of 4 prompts)
    and the reward dry run (every function on those and on 16 completions from the dataset's answers)."""
    import hf_sanity

    with tempfile.TemporaryDirectory() as out:
        run = trainer(out, 1)
        hf_sanity.preflight(trainer=run, use_config=False)  # warm-up: the first generate's set-up
        started = time.perf_counter()
        report = hf_sanity.preflight(trainer=run, use_config=False)
        total = time.perf_counter() - started
    stats = report.stats
    return {
        "setup": "GRPO preflight(trainer=...)",
        "preflight_s": total,
        "sampled_completions": stats["sampled_completions"]["completions"],
        "sampling_s": stats["sampled_completions"]["seconds"],
        "dry_run_s": stats["reward_dry_run"]["seconds"],
        "dry_run_completions": sum(stats["reward_dry_run"]["completions"].values()),
        "findings": ", ".join(f.rule for f in report.findings) or "none",
    }


def live_rollout(prompts, trainer):
    """A rollout_func sampling the live policy at the trainer's temperature and returning its own log-probs (the
    clean case of `sampler-mismatch`: what a user's wrapper around their sampler returns)."""
    import torch

    tok, model, t = trainer.processing_class, trainer.model, trainer.args.temperature
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=t, top_k=0, top_p=1.0,
                             max_new_tokens=trainer.args.max_completion_length, pad_token_id=tok.pad_token_id)  # fmt: skip
        width = enc["input_ids"].shape[1]
        completions = out[:, width:]
        mask = torch.cat([enc["attention_mask"], torch.ones_like(completions)], dim=1)
        logits = model(input_ids=out, attention_mask=mask).logits[:, width - 1 : -1].float() / t
        logps = torch.log_softmax(logits, -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    model.train(was)
    result = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for i in range(len(prompts)):
        ids = completions[i].tolist()
        n = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)
        result["prompt_ids"].append(
            [x for x, m in zip(enc["input_ids"][i].tolist(), enc["attention_mask"][i].tolist()) if m]
        )
        result["completion_ids"].append(ids[:n])
        result["logprobs"].append(logps[i, :n].tolist())
    return result


def sampler_probe_cost(steps: int = 200) -> dict:
    """The rescoring probe of `sampler-mismatch` on a GRPO run whose rollout_func samples the live policy:
    its seconds (the probe's own budget clock) against the run's wall time, with SanityCallback's defaults
    (probe_every=50)."""
    import os

    from hf_sanity import SanityCallback

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    cb = SanityCallback(use_config=False, print_findings=False)
    with tempfile.TemporaryDirectory() as out:
        run_ = trainer(out, steps, [cb], rollout_func=live_rollout)
        started = time.perf_counter()
        run_.train()
        wall = time.perf_counter() - started
    probe = cb.report.stats.get("sampler_probe", {})
    return {
        "setup": "GRPO + rollout_func (live policy), tiny 0.2M, batch 8, G=4, 32 tokens",
        "steps": steps,
        "wall_s": wall,
        "probes": probe.get("probes"),
        "probes_skipped": probe.get("skipped"),
        "probe_s": probe.get("seconds"),
        "probe_share": (probe.get("seconds") or 0.0)
        / wall,  # a fraction: run.py adds the router probe's to it
        "findings": ", ".join(f.rule for f in cb.report.findings if f.severity != "info") or "none",
    }


def run(*, quick: bool = False) -> tuple[list[dict], dict]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # the tiny model is overhead-bound: a second thread only contends (both sides alike)
    try:
        steps, repeats = (6, 2) if quick else (40, 8)
        # Issue 29's row (logging every step) and TRL's default logging_steps, each with the callback alone and
        # after a preflight(trainer=...) whose reward dry run the callback reads instead of forking its own.
        rows = [compare(steps, repeats, logging_steps=n, preflight=p) for p in (False, True) for n in (1, 10)]
        return rows, preflight_cost()
    finally:
        torch.set_num_threads(threads)
