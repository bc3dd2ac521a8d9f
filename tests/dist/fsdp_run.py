"""SanityCallback's measurements on a tiny Llama fully sharded with FSDP2 ``fully_shard``, under torchrun
(2 processes, gloo, CPU), for tests/test_fsdp.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/fsdp_run.py OUT_DIR

Trainer refuses FSDP on the CPU, so a plain training loop drives the callback: it calls the callback's events
in Trainer's order (step begin, micro-batch through ``training_step``, the gradient norm through
``_get_grad_norm``, pre-optimizer, optimizer, step end, log, train end) on an object that stands in for the
Trainer, and the callback's instruments wrap that object as they wrap a Trainer. The sharding is read from the
parameters themselves (DTensor), as it must be without a Trainer to say so.

* ``fsdp-clean``: a correct run, every decoder layer and the root sharded; nothing may be reported.
  ``ddp-clean``: the same run on replicated parameters whose gradients are averaged over ranks (what DDP does):
  what it measures is what the sharded run must measure. ``fsdp-bare``: ``fsdp-clean`` without the callback
  (its final weights must be bit-identical: the probes' forwards leave the run alone).
* ``fsdp-nan``: rank 1 alone receives a batch holding a NaN at step 3.
* ``fsdp-hot``: AdamW at a learning rate far too high: the loss blows up (finite).
* ``fsdp-stale`` / ``ddp-stale``: gradients are never cleared.
* ``fsdp-partial``: only the decoder layers are sharded; the embeddings, final norm and head stay plain tensors
  on every rank and nothing averages their gradients, so those replicas drift apart (ranks-diverged, on them).

Each process writes ``OUT_DIR/<scenario>/rank<R>.json``: what the monitors were fed, the findings it holds,
the detectors that ran and the report's stats; the main process writes the report under
``OUT_DIR/<scenario>/hf-sanity/`` and the final full weights as ``OUT_DIR/<scenario>/weights.pt``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinytrain as tt
import torch
import torch.distributed as dist

FED_KEYS = ("loss", "grad_norm", "update_ratio", "updated", "stale_norm", "n_trainable", "n_with_grad", "lr")
LR = 1e-3
HOT_LR = 1.0  # AdamW at 1000x a healthy rate: the loss climbs to 10x its start within a few steps, finite
MAX_GRAD_NORM = 1.0  # Trainer's default; the stale scenarios do not clip: clipping would hide the growth


class Loop:
    """What a Trainer offers the callback and its instruments: ``training_step`` (forward and backward of one
    micro-batch), ``_get_grad_norm``, ``args``, ``processing_class``."""

    def __init__(self, model, tok, args, *, average_grads: bool, max_grad_norm: float) -> None:
        self.model, self.processing_class, self.args = model, tok, args
        self.average_grads = average_grads  # replicated parameters: average gradients over ranks, as DDP does
        self.max_grad_norm = max_grad_norm

    def training_step(self, model, inputs):
        loss = model(**inputs).loss
        loss.backward()
        if self.average_grads:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        return loss.detach()

    def _get_grad_norm(self, model):
        """The pre-clip norm (under FSDP2 a DTensor, as Trainer gets it), clipped at ``max_grad_norm`` as Trainer
        does (0: not clipped)."""
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.grad is not None]
        if len({isinstance(p.grad, DTensor) for p in params}) < 2:
            return torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm or float("inf"))
        # fsdp-partial: sharded and plain gradients side by side, one norm each (Trainer's _mixed_mesh_grad_norm,
        # without the clipping: the scenario is about the replicas, not the step size)
        norms = [
            torch.nn.utils.get_total_norm([p.grad for p in params if isinstance(p.grad, DTensor) is sharded])
            for sharded in (True, False)
        ]
        return torch.linalg.vector_norm(
            torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms])
        )


def shard(model, *, root: bool = True):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if root:
        fully_shard(model)
    return model


def batches(tok, collate, rank: int, world: int, size: int = 2):
    """This rank's batches, cycling over its share of the rows (same order every run)."""
    rows = tt.rows(tok, 32)[rank::world]
    i = 0
    while True:
        chunk = [rows[(i + k) % len(rows)] for k in range(size)]
        i += size
        yield collate(chunk)


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0]) / dist.get_world_size()


def run(out: Path, scenario: str) -> None:
    from transformers import DataCollatorForSeq2Seq, TrainerControl, TrainerState, TrainingArguments

    from hf_sanity.callback import SanityCallback

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, tok = tt.setup()
    steps, lr, logging_steps = 12, LR, 4
    collate = DataCollatorForSeq2Seq(tok)
    if scenario == "fsdp-nan":
        collate, steps = tt.embeds_collator(tok, model, nan_at_batch=3 if rank == 1 else None), 8
    elif scenario == "fsdp-hot":
        lr, steps = HOT_LR, 16
    elif scenario.endswith("-stale") or scenario == "fsdp-partial":
        steps = 8
    sharded = scenario.startswith("fsdp-")
    if sharded:
        shard(model, root=scenario != "fsdp-partial")
    elif scenario == "ddp-clean":
        # Shards are measured whole; a replicated tensor over UPDATE_SAMPLE_ELEMENTS on an evenly strided
        # sample. The run the sharded one is compared with reads whole tensors too, so both measure the same.
        from hf_sanity.training import measures

        measures.UPDATE_SAMPLE_ELEMENTS = measures.SAMPLE_MAX_ELEMENTS  # no sampled tensor is larger
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    folder = out / scenario
    args = TrainingArguments(
        output_dir=str(folder), use_cpu=True, report_to=[], max_steps=steps, logging_steps=logging_steps,
        learning_rate=lr, lr_scheduler_type="constant", save_strategy="no", per_device_train_batch_size=2,
    )  # fmt: skip
    state = TrainerState(max_steps=steps, logging_steps=logging_steps)
    state.is_world_process_zero = state.is_local_process_zero = rank == 0
    control = TrainerControl()
    clip = 0.0 if scenario.endswith("-stale") else MAX_GRAD_NORM
    loop = Loop(model, tok, args, average_grads=not sharded, max_grad_norm=clip)
    callback = None
    fed: list[tuple[int, dict]] = []
    if scenario != "fsdp-bare":
        callback = SanityCallback(check_every=2, sync_every=1, probe_every=4, use_config=False)
        callback.on_train_begin(args, state, control, model=model, optimizer=optimizer)
        callback.trainer = loop  # what find_trainer() returns under a real Trainer
        callback.instruments.install(
            loop, None, callback
        )  # training_step and _get_grad_norm, as on a Trainer
        feed = callback.monitors.feed

        def recording(step, values):
            fed.append((step, {k: values[k] for k in FED_KEYS if k in values}))
            feed(step, values)

        callback.monitors.feed = recording
    data = batches(tok, collate, rank, world)
    window: list[float] = []
    layouts: list[list[str]] = []
    for _ in range(steps):
        if callback:
            callback.on_step_begin(args, state, control)
        loss = loop.training_step(model, next(data))
        window.append(float(loss))
        loop._get_grad_norm(model)
        if callback:
            callback.on_pre_optimizer_step(args, state, control, optimizer=optimizer)
        optimizer.step()
        if callback:
            callback.on_optimizer_step(args, state, control)
        if not scenario.endswith("-stale"):
            optimizer.zero_grad()
        state.global_step += 1
        control.should_log = state.global_step % logging_steps == 0  # DefaultFlowCallback, before ours
        if callback:
            callback.on_step_end(args, state, control)
        # After the step, with the predictions probe's forward at every 4th: the layout the run had (FSDP2
        # keeps the root's parameters gathered after a no-grad forward unless they are resharded).
        layouts.append(sorted({type(p).__name__ for p in model.parameters()}))
        if control.should_log:  # Trainer logs the mean over ranks of the losses since the last log
            logged = mean_over_ranks(sum(window) / len(window))
            state.log_history.append({"loss": logged, "learning_rate": lr, "step": state.global_step})
            window = []
            if callback:
                callback.on_log(args, state, control, logs=state.log_history[-1])
            control.should_log = False
    if callback:
        callback.on_train_end(args, state, control)
    full = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(full, folder / "weights.pt")
    seen = {
        "steps": state.global_step,
        "fed": [
            [s, {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}]
            for s, d in fed
        ],
        "findings": [
            {"rule": f.rule, "step": f.step, "evidence": f.evidence} for f in callback.report.findings
        ]
        if callback
        else [],
        "ran": sorted(callback.monitors.ran) if callback else [],
        "stats": callback.report.stats if callback else {},
        "layouts": {n: type(p).__name__ for n, p in model.named_parameters()},
        "layouts_after_steps": layouts,
    }
    (folder / f"rank{rank}.json").write_text(json.dumps(seen, default=str))


SCENARIOS = (
    "fsdp-clean",
    "ddp-clean",
    "fsdp-bare",
    "fsdp-nan",
    "fsdp-hot",
    "fsdp-stale",
    "ddp-stale",
    "fsdp-partial",
)

if __name__ == "__main__":
    dist.init_process_group("gloo")
    target = Path(sys.argv[1])
    only = sys.argv[2:] or SCENARIOS
    for name in only:
        run(target, name)
        dist.barrier()
    dist.destroy_process_group()
