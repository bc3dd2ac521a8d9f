"""hf-sanity: finds the silent bugs of Hugging Face fine-tuning, before and during training.

    import hf_sanity
    report = hf_sanity.preflight(model=model, tokenizer=tokenizer, dataset=train, max_len=2048)
    report = hf_sanity.preflight(trainer=trainer)            # the exact batches the model will see
    report = hf_sanity.doctor(["out/checkpoint-500"])        # post-mortem of a finished run
"""

__version__ = "0.1.0"

from hf_sanity.doctor import doctor
from hf_sanity.findings import Finding
from hf_sanity.preflight.run import preflight  # the function shadows its package here
from hf_sanity.report import Report

__all__ = ["Finding", "Report", "__version__", "doctor", "preflight"]
