"""Preflight: inspect model, tokenizer, data and adapter before a single training step."""

from hf_sanity.preflight.run import preflight, run_checks

__all__ = ["preflight", "run_checks"]
