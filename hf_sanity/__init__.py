"""hf-sanity: finds the silent bugs of Hugging Face fine-tuning, before and during training."""

__version__ = "0.1.0"

from hf_sanity.findings import Finding
from hf_sanity.report import Report

__all__ = ["Finding", "Report", "__version__"]
