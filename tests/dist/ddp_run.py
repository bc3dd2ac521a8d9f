"""Two scenarios under torchrun (2 processes, gloo, CPU) for tests/test_callback_dist.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist/ddp_run.py OUT_DIR

* ``OUT_DIR/nan``: rank 1 alone receives a batch holding a NaN at step 3; every rank goes on (abort off).
* ``OUT_DIR/drift``: at steps 3 and 4 each rank calls the model inside DDP directly, so no gradient is
  averaged and the replicas drift apart.
* ``OUT_DIR/clean``: a correct run; nothing may be reported. ``OUT_DIR/clean-s1-b4`` (and the other seed and
  batch-size pairs): longer correct runs at other seeds and per-device batch sizes, silent too.
* ``OUT_DIR/hot``: AdamW at a learning rate far too high: the loss blows up (finite) and must be caught.
* ``OUT_DIR/abort``: the ``nan`` run with ``abort_on="error"``: every rank stops after step 3.

Each run writes its report (main process only) under ``OUT_DIR/<scenario>/hf-sanity/``; each process also
writes ``OUT_DIR/<scenario>/rank<R>.json`` with what it saw, for the test to compare.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinytrain as tt
import torch
from transformers import Trainer

from hf_sanity.callback import SanityCallback

RANK = int(os.environ.get("RANK", "0"))
COMMON = dict(ddp_backend="gloo", max_steps=8, logging_steps=4, per_device_train_batch_size=2)


class Drifting(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.state.global_step in (2, 3) and hasattr(model, "module"):
            model = model.module  # bypasses DistributedDataParallel: this rank's gradients stay its own
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


CLEAN_LONG = [(seed, batch) for seed in (1, 2) for batch in (2, 4)]


def run(out: Path, scenario: str) -> None:
    model, tok = tt.setup()
    callback = SanityCallback(check_every=2, sync_every=1, probe_every=4, use_config=False)
    kwargs = dict(COMMON)
    if scenario in ("nan", "abort"):
        kwargs["collator"] = tt.embeds_collator(tok, model, nan_at_batch=3 if RANK == 1 else None)
        if scenario == "abort":
            callback = SanityCallback(abort_on="error", check_every=2, sync_every=1, probe_every=4, use_config=False)
    elif scenario == "drift":
        kwargs["cls"] = Drifting
    elif scenario == "hot":
        kwargs.update(learning_rate=50.0, max_steps=20)
    elif scenario.startswith("clean-"):
        seed, batch = (int(part[1:]) for part in scenario.split("-")[1:])
        kwargs.update(seed=seed, data_seed=seed, per_device_train_batch_size=batch, max_steps=40, logging_steps=2,
                      learning_rate=1e-3)  # fmt: skip
        callback = SanityCallback(use_config=False)  # the defaults a user runs with
    trainer = tt.trainer(out / scenario, callbacks=[callback], model=model, tok=tok, **kwargs)
    trainer.train()
    trainer.save_state()  # trainer_state.json: the logged (all-rank mean) loss the user sees
    seen = [{"rule": f.rule, "step": f.step, "evidence": f.evidence} for f in callback.report.findings]
    (out / scenario / f"rank{RANK}.json").write_text(
        json.dumps({"steps": trainer.state.global_step, "findings": seen, "ran": sorted(callback.monitors.ran),
                    "aborted_at_step": trainer.state.hf_sanity_aborted_at_step})
    )


if __name__ == "__main__":
    target = Path(sys.argv[1])
    for name in ("nan", "drift", "clean", "hot", "abort", *(f"clean-s{s}-b{b}" for s, b in CLEAN_LONG)):
        run(target, name)
        torch.distributed.barrier()
