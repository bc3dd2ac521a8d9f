"""preflight(trainer=SFTTrainer) on 500 vision-language rows against the trainer's own collation of them: the tiny
LLaVA of `hf_sanity.testing.vlm` (Qwen2.5's real tokenizer), TRL's vision-language collator with
``max_length=256`` (so that every row's image span is checked), every rule at its defaults. Two kinds of pictures:
the test suite's 32-40 px squares held in the dataset (a collation that costs almost nothing, so that the model
checks' fixed cost shows), and 640x480 JPEG photographs-like pictures read from files (an ``images`` column of
paths, the size of the pictures of common VLM datasets), one a row. The collation is one pass of ``trainer.get_train_dataloader()`` over the rows (what an epoch's data
loading costs the trainer, the processor included); preflight's time is everything it does, model checks included;
the image-span check (the per-row vision work) is also timed alone. One run after a warm-up on 16 rows.
"""

from __future__ import annotations

import tempfile
import time

PHOTO_SIZE = (640, 480)


def _photo_rows(folder, rows: int):
    """The prompt-completion rows of ``vlm_prompt_completion`` with each picture a 640x480 JPEG file: smooth
    colour fields with noise, so that decoding and resizing cost what a photograph's do."""
    from pathlib import Path

    import datasets
    import numpy as np
    from PIL import Image

    from hf_sanity.testing import vlm

    data = vlm.vlm_prompt_completion(rows).remove_columns("images")
    rng = np.random.default_rng(0)
    width, height = PHOTO_SIZE
    ramp = np.linspace(0, 1, width)[None, :, None] * np.linspace(0, 1, height)[:, None, None]
    paths = []
    for row in range(rows):
        base = (ramp * rng.integers(40, 255, size=3) + rng.normal(0, 12, (height, width, 3))).clip(0, 255)
        path = Path(folder) / f"photo-{row}.jpg"
        Image.fromarray(base.astype(np.uint8)).save(path, quality=90)
        paths.append([str(path)])
    data = data.add_column("images", paths)
    return data.cast_column("images", datasets.Sequence(datasets.Image()))


def _trainer(folder, rows: int, photos: bool = False):
    from hf_sanity.testing import vlm

    data = _photo_rows(folder, rows) if photos else vlm.vlm_prompt_completion(rows)
    return vlm.vlm_sft_trainer(folder, data, max_length=256, per_device_train_batch_size=8)


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


def run(*, quick: bool = False) -> list[dict]:
    from hf_sanity.testing.vlm import real_qwen_tokenizer_dir

    if not real_qwen_tokenizer_dir().is_dir():
        return [{"setup": "Qwen2.5's tokenizer not found (shared/real-tokenizers): skipped"}]
    rows = 100 if quick else 500
    return [_row(rows, photos=False), _row(rows, photos=True)]


def _row(rows: int, *, photos: bool) -> dict:
    import hf_sanity

    pictures = "640x480 JPEG files" if photos else "32-40 px pictures in the dataset"
    with tempfile.TemporaryDirectory() as folder:
        hf_sanity.preflight(
            trainer=_trainer(folder, 16), use_config=False
        )  # warm-up: imports, first forwards
        trainer = _trainer(folder, rows, photos)
        collation = _collate_all(trainer)
        started = time.perf_counter()
        report = hf_sanity.preflight(trainer=trainer, use_config=False)
        preflight = time.perf_counter() - started
        spans = _span_check(trainer)
    return {
        "setup": f"{rows} VLM rows (prompt-completion), one picture each: {pictures}",
        "collation_s": round(collation, 2),
        "preflight_s": round(preflight, 2),
        "preflight_over_collation": f"{preflight / collation:.2f}x",
        "target": "<= 2x",
        "met": "met" if preflight <= 2 * collation else "not met",
        "image_span_check_s": round(spans, 2),
        "span_check_over_collation": f"{spans / collation:.2f}x",
        "findings": ", ".join(f.rule for f in report.findings) or "none",
    }
