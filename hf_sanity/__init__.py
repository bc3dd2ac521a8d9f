"""hf-sanity: finds the silent bugs of Hugging Face fine-tuning, before and during training.

import hf_sanity
report = hf_sanity.preflight(model=model, tokenizer=tokenizer, dataset=train, max_len=2048)
report = hf_sanity.preflight(trainer=trainer)            # the exact batches the model will see
trainer = Trainer(..., callbacks=[hf_sanity.SanityCallback()])
report = hf_sanity.diagnose(trainer=trainer)             # the ordered debugging protocol
report = hf_sanity.doctor(["out/checkpoint-500"])        # post-mortem of a finished run
"""

__version__ = "0.1.0"

# `preflight` and `doctor` are also module names here: binding the functions now, after their modules are
# imported, keeps `hf_sanity.preflight(...)` the function for good.
from hf_sanity.doctor import doctor
from hf_sanity.findings import Finding
from hf_sanity.preflight.run import preflight
from hf_sanity.report import Report

_LAZY = {  # imported on first use: they pull in transformers/torch
    "SanityCallback": "hf_sanity.callback",
    "overfit": "hf_sanity.protocol",
    "diagnose": "hf_sanity.protocol",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_sanity' has no attribute {name!r}")


__all__ = ["Finding", "Report", "SanityCallback", "__version__", "diagnose", "doctor", "overfit", "preflight"]
