"""A plain Trainer script, as a user writes one, for tests/test_launch.py (`hf-sanity run/preflight -- CMD`).

    python tests/dist/launched.py SCENARIO OUT_DIR          # or under torchrun (gloo, CPU)

* ``clean``: a correct 8-step run on the tiny setup, with checkpoints every 4 steps; after ``train()`` the
  script saves the model and writes ``OUT_DIR/after-train.txt``.
* ``twice``: two trainers, one after the other (``OUT_DIR/a``, ``OUT_DIR/b``); the second with an LR far too high.
* ``yours``: the user's own ``SanityCallback(abort_on="error")`` in ``callbacks=``.
* ``crash-loss``: the user's ``compute_loss`` calls ``cross_entropy`` on mismatched shapes at the first step.
* ``crash-init``: the user's Trainer subclass raises in its ``__init__``, after Trainer's.
* ``vocab-beyond``: the tokenizer got a token the model's embedding was never resized for, and every row holds
  it (the run dies at step 1 with torch's IndexError, as LLaMA-Factory's does without ``resize_vocab``).
* ``no-trainer``: imports transformers' Trainer and builds none.
* ``no-train``: builds a trainer and never calls ``train()``.

Each process writes ``OUT_DIR/rank<R>.json``: the callbacks of its trainer(s) when training ended.
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

SCENARIO, OUT = sys.argv[1], Path(sys.argv[2])
RANK = int(os.environ.get("RANK", "0"))
DISTRIBUTED = int(os.environ.get("WORLD_SIZE", "1")) > 1
COMMON = dict(max_steps=8, logging_steps=4, per_device_train_batch_size=2)
if DISTRIBUTED:
    COMMON["ddp_backend"] = "gloo"


class MismatchedLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return torch.nn.functional.cross_entropy(outputs.logits, inputs["labels"])  # (B, T, V) vs (B, T)


class BrokenSetup(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        raise ValueError("the user's setup is broken")


def callbacks_of(trainer) -> list[str]:
    return [type(cb).__name__ for cb in trainer.callback_handler.callbacks]


seen: dict[str, list[str]] = {}
if SCENARIO in ("clean", "no-train"):
    trainer = tt.trainer(OUT, save_strategy="steps", save_steps=4, **COMMON)
    if SCENARIO == "clean":
        trainer.train()
        seen["trainer"] = callbacks_of(trainer)
        trainer.save_model(str(OUT / "final"))
        (OUT / "after-train.txt").write_text("train() returned\n")
elif SCENARIO == "twice":
    for name, lr in (("a", 3e-3), ("b", 3.0)):
        trainer = tt.trainer(OUT / name, learning_rate=lr, **COMMON)
        trainer.train()
        seen[name] = callbacks_of(trainer)
elif SCENARIO == "yours":
    from hf_sanity import SanityCallback

    trainer = tt.trainer(OUT, callbacks=[SanityCallback(abort_on="error", print_findings=False)], **COMMON)
    trainer.train()
    seen["trainer"] = callbacks_of(trainer)
elif SCENARIO == "crash-loss":
    tt.trainer(OUT, cls=MismatchedLoss, **COMMON).train()
elif SCENARIO == "crash-init":
    tt.trainer(OUT, cls=BrokenSetup, **COMMON)
elif SCENARIO == "vocab-beyond":
    tt.vocab_beyond_trainer(OUT, **COMMON).train()
elif SCENARIO == "no-trainer":
    print("built no trainer")
else:
    raise SystemExit(f"unknown scenario {SCENARIO}")
if seen:
    (OUT / f"rank{RANK}.json").write_text(json.dumps(seen))
