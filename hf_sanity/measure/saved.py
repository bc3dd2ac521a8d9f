"""A folder the model was saved to (a Trainer checkpoint), read for what a server needs beside the weights to
process inputs the way training did: for a vision-language run, the image processor's settings (its
``preprocessor_config.json``, or the ``image_processor`` of a ``processor_config.json``) and a chat template
(``chat_template.jinja`` / ``chat_template.json``, or a ``chat_template`` in the tokenizer's or processor's
config)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hf_sanity.measure.vision import Modality, has_vision_processor

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
CONFIGS_WITH_TEMPLATE = ("tokenizer_config.json", "processor_config.json")


@dataclass(frozen=True)
class SavedFolder:
    path: str
    step: int | None
    modality: Modality
    files: tuple[str, ...]
    has_image_processor: bool  # the image processor's settings are in the folder
    has_chat_template: bool
    trainer_has_processor: bool  # the trainer's processing_class carries an image processor (what it saves)
    processing_class: str | None  # "tokenizer-only" when the trainer's processing_class is a bare tokenizer


def _json(path: Path) -> dict:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def read_saved(path: Path, step: int | None, modality: Modality, processing_class=None) -> SavedFolder:
    files = tuple(sorted(p.name for p in path.iterdir() if p.is_file()))
    image = "preprocessor_config.json" in files or "image_processor" in _json(path / "processor_config.json")
    template = any(name in files for name in TEMPLATE_FILES) or any(
        _json(path / name).get("chat_template") for name in CONFIGS_WITH_TEMPLATE if name in files
    )
    bare = processing_class is not None and hasattr(processing_class, "convert_tokens_to_ids")
    return SavedFolder(
        str(path), step, modality, files, image, bool(template), has_vision_processor(processing_class),
        "tokenizer-only" if bare and not has_vision_processor(processing_class) else None,
    )  # fmt: skip


def last_checkpoint(output_dir, step: int) -> Path | None:
    """The checkpoint the Trainer saved at ``step`` under ``output_dir`` (``checkpoint-STEP``), else the newest
    one; None when the run saved none."""
    root = Path(output_dir)
    exact = root / f"checkpoint-{step}"
    if exact.is_dir():
        return exact
    saved = [p for p in root.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return max(saved, key=lambda p: int(p.name.split("-")[-1])) if saved else None
