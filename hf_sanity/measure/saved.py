"""A folder the model was saved to (a Trainer checkpoint), read for what a server needs beside the weights to
process inputs the way training did: for a vision-language run, the image processor's settings (its
``preprocessor_config.json``, or the ``image_processor`` of a ``processor_config.json``) and a chat template
(``chat_template.jinja`` / ``chat_template.json``, or a ``chat_template`` in the tokenizer's or processor's
config)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

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
    from_trainer: bool = True  # a checkpoint of a running Trainer; False: a folder a server loads
    # The processor the server uses (or the folder it loads it from): `served` and `outputs` only.
    serving_processor: Any = field(default=None, compare=False, repr=False)

    @cached_property
    def image_settings(self):
        """The processor saved here against the serving one, on a reference picture
        (`measure.image_settings`); None without both."""
        if self.serving_processor is None or not self.has_image_processor:
            return None
        from transformers import AutoProcessor

        from hf_sanity.measure.image_settings import compare_image_settings

        serving = self.serving_processor
        if isinstance(serving, Path):  # a folder the server loads its processor from
            serving = AutoProcessor.from_pretrained(str(serving))
        return compare_image_settings(AutoProcessor.from_pretrained(self.path), serving)


def _json(path: Path) -> dict:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def read_saved(
    path: Path, step: int | None, modality: Modality, processing_class=None, *, from_trainer: bool = True
) -> SavedFolder:
    files = tuple(sorted(p.name for p in path.iterdir() if p.is_file()))
    image = "preprocessor_config.json" in files or "image_processor" in _json(path / "processor_config.json")
    template = any(name in files for name in TEMPLATE_FILES) or any(
        _json(path / name).get("chat_template") for name in CONFIGS_WITH_TEMPLATE if name in files
    )
    bare = processing_class is not None and hasattr(processing_class, "convert_tokens_to_ids")
    return SavedFolder(
        str(path), step, modality, files, image, bool(template), has_vision_processor(processing_class),
        "tokenizer-only" if bare and not has_vision_processor(processing_class) else None, from_trainer,
    )  # fmt: skip


def served_folder(model, adapter=None, serving_processor=None) -> SavedFolder | None:
    """The folder a vision-language model is served from, read: the saved adapter's when one is attached,
    else the local folder the model was loaded from (``name_or_path``); None for a text model, or a model
    not loaded from a local folder (a hub id: its processor is the hub's). ``serving_processor``: the processor
    the server uses, compared with the one saved there (a processor without an image processor is none)."""
    from hf_sanity.measure.vision import measure_modality

    modality = measure_modality(None, model)
    if not modality.is_vision:
        return None
    folder = Path(adapter) if adapter else Path(str(getattr(model, "name_or_path", "") or ""))
    if not str(folder) or not folder.is_dir():
        return None
    subject = read_saved(folder, None, modality, from_trainer=False)
    if isinstance(serving_processor, Path) or has_vision_processor(serving_processor):
        import dataclasses

        subject = dataclasses.replace(subject, serving_processor=serving_processor)
    return subject


def last_checkpoint(output_dir, step: int) -> Path | None:
    """The checkpoint the Trainer saved at ``step`` under ``output_dir`` (``checkpoint-STEP``), else the newest
    one; None when the run saved none."""
    root = Path(output_dir)
    exact = root / f"checkpoint-{step}"
    if exact.is_dir():
        return exact
    saved = [p for p in root.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return max(saved, key=lambda p: int(p.name.split("-")[-1])) if saved else None


def processor_beside(tokenizer) -> Path | None:
    """The folder ``tokenizer`` was loaded from, when an image processor is saved there (what a server that
    loads that folder uses; loaded when a rule reads it); else None."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if not str(folder) or not folder.is_dir():
        return None
    has_config = "image_processor" in _json(folder / "processor_config.json")
    return folder if has_config or (folder / "preprocessor_config.json").is_file() else None
