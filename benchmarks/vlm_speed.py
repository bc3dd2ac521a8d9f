"""preflight(trainer=SFTTrainer) on 500 vision-language rows against the trainer's own collation of them: the tiny
LLaVA of `hf_sanity.testing.vlm` (Qwen2.5's real tokenizer, one 32-40 px picture a row), TRL's
vision-language collator with ``max_length=256`` (so that every row's image span is checked), every rule at its
defaults. The collation is one pass of ``trainer.get_train_dataloader()`` over the rows (what an epoch's data
loading costs the trainer, the processor included); preflight's time is everything it does, model checks included;
the image-span check (the per-row vision work) is also timed alone. One run after a warm-up on 16 rows.
"""

from __future__ import annotations

import tempfile
import time


def _trainer(folder, rows: int):
    from hf_sanity.testing import vlm

    return vlm.vlm_sft_trainer(
        folder, vlm.vlm_prompt_completion(rows), max_length=256, per_device_train_batch_size=8
    )


def _collate_all(trainer) -> float:
    started = time.perf_counter()
    for _ in trainer.get_train_dataloader():
        pass
    return time.perf_counter() - started


def _span_check(trainer) -> float:
    """The per-row vision work alone: every row's image span through the collator (`image-span-truncated`,
    `vision-token-budget`); the rest of preflight is the model checks' forwards, a cost that does not grow
    with the rows."""
    from hf_sanity.measure.vision import image_spans, measure_modality

    modality = measure_modality(trainer.processing_class, trainer.model)
    started = time.perf_counter()
    image_spans(trainer, modality, [])
    return time.perf_counter() - started


def run(*, quick: bool = False) -> dict:
    import hf_sanity
    from hf_sanity.testing.vlm import real_qwen_tokenizer_dir

    if not real_qwen_tokenizer_dir().is_dir():
        return {"setup": "Qwen2.5's tokenizer not found (shared/real-tokenizers): skipped"}
    rows = 100 if quick else 500
    with tempfile.TemporaryDirectory() as folder:
        hf_sanity.preflight(
            trainer=_trainer(folder, 16), use_config=False
        )  # warm-up: imports, first forwards
        trainer = _trainer(folder, rows)
        collation = _collate_all(trainer)
        started = time.perf_counter()
        report = hf_sanity.preflight(trainer=trainer, use_config=False)
        preflight = time.perf_counter() - started
        spans = _span_check(trainer)
    return {
        "setup": f"{rows} VLM rows (prompt-completion, one picture each), tiny LLaVA, max_length=256",
        "collation_s": round(collation, 2),
        "preflight_s": round(preflight, 2),
        "preflight_over_collation": f"{preflight / collation:.2f}x",
        "target": "<= 2x",
        "image_span_check_s": round(spans, 2),
        "span_check_over_collation": f"{spans / collation:.2f}x",
        "findings": ", ".join(f.rule for f in report.findings) or "none",
    }
