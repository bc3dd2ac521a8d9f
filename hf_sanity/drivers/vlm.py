"""The CLI's vision-language inputs: a model folder with a processor that has an image processor, and a dataset
whose rows carry pictures (an ``images`` / ``image`` column of file paths, read relative to the data file, or
TRL's image columns of a saved dataset). They become TRL's SFTTrainer, built in memory as the user's training
would build it (output in a temporary folder, removed after), so that preflight reads the trainer's real
collated batches, as ``preflight(trainer=)`` does.
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_sanity.errors import UserInputError

IMAGE_COLUMNS = ("images", "image")
# Files a processor saves beside the model (the image processor's config, or the processor's own).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def image_column(data) -> str | None:
    columns = getattr(data, "column_names", None) or ()
    return next((name for name in IMAGE_COLUMNS if name in columns), None)


def load_vision_processor(ref: str, *, trust_remote_code: bool = False):
    """The processor saved in the model folder ``ref`` when it has an image (or video) processor; else None
    (a text model, or a folder without a processor: the text checks apply)."""
    from hf_sanity.measure.vision import has_vision_processor

    path = Path(os.path.expanduser(ref))
    if not path.is_dir() or not any((path / name).is_file() for name in PROCESSOR_FILES):
        return None
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise UserInputError(
            f"cannot load the processor saved in {ref!r}: {str(exc).strip().splitlines()[0]}"
        ) from None
    return processor if has_vision_processor(processor) else None


def with_pictures(data, column: str, base: Path, ref: str):
    """``data`` with its ``column`` of file paths (one path or a list a row) read as PIL images, each path
    relative to ``base`` (the data file's folder) unless absolute. A path that is not a readable image is bad
    input: one line, its row. Columns already of images (a saved dataset's Image feature) are kept."""
    from PIL import Image

    def load(value, row: int):
        if not isinstance(value, str):
            return value  # a decoded picture (datasets' Image feature) or None
        path = Path(os.path.expanduser(value))
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise UserInputError(
                f"dataset {ref!r} row {row}: image {value!r} not found (looked for {path}; paths are read "
                "relative to the data file)"
            )
        try:
            with Image.open(path) as picture:
                return picture.convert("RGB")
        except Exception as exc:
            raise UserInputError(f"dataset {ref!r} row {row}: cannot read image {value!r}: {exc}") from None

    values = data[column]
    if not any(isinstance(p, str) for v in values for p in (v if isinstance(v, list) else [v])):
        return data  # nothing to read: the pictures are already decoded
    pictures = [
        [load(p, row) for p in v] if isinstance(v, list) else load(v, row) for row, v in enumerate(values)
    ]
    import datasets

    columns = {name: data[name] for name in data.column_names if name != column}
    return datasets.Dataset.from_dict({**columns, column: pictures})


def data_folder(ref: str) -> Path:
    path = Path(os.path.expanduser(ref))
    return path if path.is_dir() else path.parent


# --loss-on as TRL's SFTConfig says it for vision-language rows.
LOSS_ON_CONFIG = {
    "assistant": {"assistant_only_loss": True},
    "completion": {"completion_only_loss": True},
    "all": {"completion_only_loss": False},
}


def vlm_trainer(model_ref: str, processor, data, *, max_len: int | None, loss_on: str | None, output_dir: str,
                adapter: str | None = None, trust_remote_code: bool = False):  # fmt: skip
    """TRL's SFTTrainer on the model, its processor and the rows, as the user's training would build it:
    TRL's vision-language collator, ``max_length`` from --max-len (None: no cut), the loss where --loss-on
    says (default: TRL's for the format); with ``adapter`` (--adapter), the saved adapter on the model as a
    training that goes on with it loads it (trainable). Nothing is trained or saved; ``output_dir`` is a
    temporary folder."""
    import torch
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    from hf_sanity.measure.sources import check_model_folder

    check_model_folder(model_ref)
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            model_ref, dtype="auto", trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise UserInputError(
            f"cannot load a vision-language model from {model_ref!r}: {str(exc).strip().splitlines()[0]}"
        ) from None
    import warnings

    if adapter:
        model = _with_adapter(model, adapter)

    with warnings.catch_warnings():  # transformers' deprecation notes on TRL's defaults: not the user's doing
        warnings.simplefilter("ignore", FutureWarning)
        config = SFTConfig(
            output_dir=output_dir, max_length=max_len, report_to=[], save_strategy="no", logging_strategy="no",
            use_cpu=not torch.cuda.is_available(), bf16=False, disable_tqdm=True, per_device_train_batch_size=8,
            **LOSS_ON_CONFIG.get(loss_on or "", {}),
        )  # fmt: skip
    return SFTTrainer(model=model, args=config, train_dataset=data, processing_class=processor)


def _with_adapter(model, adapter: str):
    """``model`` with the saved adapter loaded trainable (a folder the loader has checked); one line where peft
    cannot put it on this model."""
    import warnings

    from peft import PeftModel

    try:
        # peft reads transformers' deprecated names: warnings the user cannot act on
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return PeftModel.from_pretrained(model, adapter, is_trainable=True)
    except Exception as exc:
        raise UserInputError(
            f"cannot load the adapter {adapter!r} on this model: {str(exc).strip().splitlines()[0]}"
        ) from None
