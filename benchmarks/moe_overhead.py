"""The router probe's cost on a 200-step mixture-of-experts run: `expert-collapse` counts where the routers send
the probe batch's tokens inside the probe forwards the callback runs anyway (the step-0 probe and the
predictions probe), so what it adds is one scatter per MoE layer per probe.

The tiny Qwen3-MoE trained with the load-balancing loss (`hf_sanity.testing.moe.trained_moe_dir`: 16 experts,
2 per token, 2 MoE layers) under TRL's ``SFTTrainer``, 200 steps of batch 4, ``SanityCallback()`` with its
defaults, one CPU thread. Three figures against the run's wall time: the probe forwards themselves (budgeted at
0.1% of the run after their first runs, routers counted or not), the router counting they carry (timed on its
own, times the probes the run made), and the callback's own clock.
"""

from __future__ import annotations

import statistics
import tempfile
import time


def trainer(out: str, steps: int, callbacks=()):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from hf_sanity.testing import as_prompt_completion, demo_conversations
    from hf_sanity.testing.moe import trained_moe_dir

    folder = trained_moe_dir()
    data = datasets.Dataset.from_list(as_prompt_completion(demo_conversations(256), conversational=True))
    config = SFTConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=10,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, max_length=128, bf16=False,
    )  # fmt: skip
    return SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder), args=config, train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(folder), callbacks=list(callbacks),
    )  # fmt: skip


def counting_cost(model, batch, repeats: int) -> tuple[float, float]:
    """(seconds of one probe forward, seconds of the router counting it carries): the forward's median over
    ``repeats``; the counting timed on its own (each router's output of that forward counted, the per-layer
    numbers formed and read, as the recorder reads them later), median over 10x as many, since it is well
    inside the forward's own noise."""
    from hf_sanity.measure import moe
    from hf_sanity.training import probe

    routers = moe.routers_of(model)
    outputs = {}

    def keep(name):
        def hook(module, args, output) -> None:  # returns None: the output goes on unchanged
            outputs[name] = (module, output)

        return hook

    hooks = [module.register_forward_hook(keep(name)) for name, module in routers.modules]
    try:
        probe.probe(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    mask = batch.get("attention_mask")

    def forward() -> float:
        started = time.perf_counter()
        probe.probe(model, batch)
        return time.perf_counter() - started

    def count() -> float:
        started = time.perf_counter()
        measured = [
            (name, moe._expert_counts(module, out, routers.output_index, routers.top_k, mask))
            for name, (module, out) in outputs.items()
        ]
        moe._load(measured).plain()
        return time.perf_counter() - started

    forward(), count()  # warm-up
    return statistics.median(forward() for _ in range(repeats)), statistics.median(
        count() for _ in range(10 * repeats)
    )


def run(*, quick: bool = False) -> dict:
    import torch

    from hf_sanity import SanityCallback

    steps = 40 if quick else 200
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is overhead-bound: a second thread only contends
    try:
        cb = SanityCallback(use_config=False, print_findings=False)
        with tempfile.TemporaryDirectory() as out:
            run_ = trainer(out, steps, [cb])
            started = time.perf_counter()
            run_.train()
            wall = time.perf_counter() - started
            forward, counting = counting_cost(run_.model, cb.first._probe_batch, repeats=20 if quick else 200)
    finally:
        torch.set_num_threads(threads)
    probes = cb.first.budget.runs + 1  # the predictions probes, and the step-0 probe of the first batch
    router_s = probes * counting
    stats = cb.report.stats
    return {
        "model": "tiny Qwen3-MoE 0.55M, 16 experts top-2, batch 4",
        "steps": steps,
        "wall_s": wall,
        "probes": probes,
        "probe_forward_ms": 1000 * forward,
        "router_count_ms_per_probe": 1000 * counting,
        "router_share": f"{router_s / wall:.4%}",
        # the first batch's probe is one forward more than the budget counts
        "probe_forwards_share": f"{(cb.first.budget.spent + forward) / wall:.3%}",
        "callback_share": stats.get("callback_share"),
        "top_checks_s": ", ".join(
            f"{k} {v:.3f}" for k, v in list(stats["callback_seconds_by_check"].items())[:3]
        ),
        "findings": ", ".join(f.rule for f in cb.report.findings if f.severity != "info") or "none",
    }
