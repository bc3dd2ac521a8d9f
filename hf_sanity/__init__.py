"""hf-sanity: finds the silent bugs of Hugging Face fine-tuning, before and during training.

import hf_sanity
report = hf_sanity.preflight(model=model, tokenizer=tokenizer, dataset=train, max_len=2048)
report = hf_sanity.preflight(trainer=trainer)            # the exact batches the model will see
trainer = Trainer(..., callbacks=[hf_sanity.SanityCallback()])
report = hf_sanity.diagnose(trainer=trainer)             # the ordered debugging protocol
report = hf_sanity.served(merged, base=base, adapter="out/adapter", tokenizer=tokenizer)  # what is served
report = hf_sanity.doctor(["out/checkpoint-500"])        # post-mortem of a finished run
report = hf_sanity.outputs(model=model, tokenizer=tokenizer, dataset=held_out)  # what the model says
hf_sanity.show(trainer=trainer).print()                  # the exact batch the model is fed, decoded
fixed = hf_sanity.fix(model=model, tokenizer=tokenizer, dataset=train)  # remedies on a copy, checked again
"""

from hf_sanity.version import __version__

# Imported on first use: most of them pull in torch and transformers, and `hf-sanity rules` or a bad option
# should answer before those load.
_PUBLIC = {
    "preflight": "hf_sanity.drivers.preflight",
    "fix": "hf_sanity.drivers.fix",
    "doctor": "hf_sanity.drivers.doctor",
    "outputs": "hf_sanity.drivers.outputs",
    "served": "hf_sanity.drivers.served",
    "show": "hf_sanity.drivers.show",
    "SanityCallback": "hf_sanity.callback",
    "overfit": "hf_sanity.protocol",
    "diagnose": "hf_sanity.protocol",
    "Finding": "hf_sanity.findings",
    "Report": "hf_sanity.report",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hf_sanity' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = [
    "Finding",
    "Report",
    "SanityCallback",
    "__version__",
    "diagnose",
    "doctor",
    "fix",
    "outputs",
    "overfit",
    "preflight",
    "served",
    "show",
]
