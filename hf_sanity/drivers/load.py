"""Loading a setup from the command line's paths: one sequence for every command (preflight, show, fix, outputs,
served), so that a folder is checked, and a bad one reported, the same way whichever command reads it.

The order is the cheapest failure first: the paths themselves (:func:`check_paths`, before torch, transformers
or datasets are imported, so that a typo is one line in a blink), the model's config (a broken folder fails
before the data is read), an adapter, the tokenizers, the data. The model's weights load last, and only when a
command needs them (``Setup.load_model``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_sanity.errors import UserInputError
from hf_sanity.measure.sources import check_dataset_path, check_model_folder, looks_local, missing_path


def quiet_libraries() -> None:
    """transformers' warnings and progress bars off: the report says what matters."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def check_tokenizer_path(ref: str | None, kind: str) -> None:
    if ref and looks_local(ref) and not Path(os.path.expanduser(ref)).exists():
        raise missing_path(kind, ref)


def check_paths(
    model: str | None = None,
    dataset: str | None = None,
    *,
    tokenizer: str | None = None,
    weights: bool = True,
    eval_dataset: str | None = None,
    inference_tokenizer: str | None = None,
    base: str | None = None,
) -> None:
    """Bad input that the file system alone shows (a missing file or folder, an unknown data file type, a model
    folder without weights), in the order the loaders meet it; before any heavy import."""
    for ref, needs_weights in ((model, weights), (base, True)):
        if ref:  # the loaders' own check: a missing folder, a file, a folder without weights
            check_model_folder(ref, needs_weights)
    if tokenizer:
        check_tokenizer_path(tokenizer, "tokenizer")
    for ref in (dataset, eval_dataset):
        if ref:
            check_dataset_path(ref)
    check_tokenizer_path(inference_tokenizer, "inference tokenizer")


def check_adapter(adapter: str | os.PathLike) -> dict:
    """A saved PEFT adapter folder, readable: its state (or one line saying what is wrong)."""
    from hf_sanity.measure.adapters import adapter_config, adapter_state

    if not Path(adapter).is_dir():
        raise UserInputError(
            f"adapter {str(adapter)!r} is not a folder; pass the folder written by peft's save_pretrained"
        )
    adapter_config(adapter)
    return adapter_state(adapter)


def load_tokenizer_of(model: str, tokenizer: str | None, *, trust_remote_code: bool = False):
    """``--tokenizer``, else the model folder's own."""
    from hf_sanity.measure.sources import load_tokenizer

    return load_tokenizer(
        tokenizer or model, trust_remote_code=trust_remote_code, kind="tokenizer" if tokenizer else "model"
    )


@dataclass
class Setup:
    """What a command's paths hold, loaded (the model's weights on demand)."""

    model_ref: str
    config: Any
    tokenizer: Any
    dataset: Any
    eval_dataset: Any = None
    inference_tokenizer: Any = None
    processor: Any = None  # a vision-language model's processor, when the rows carry pictures
    pictures: str | None = None  # the rows' picture column
    trust_remote_code: bool = False
    seconds: float = 0.0  # loading time, weights excluded

    def load_model(self, **kwargs):
        from hf_sanity.measure.sources import load_model

        return load_model(self.model_ref, trust_remote_code=self.trust_remote_code, **kwargs)

    def generation_config(self):
        from hf_sanity.measure.sources import load_generation_config

        return load_generation_config(self.model_ref)


def from_paths(
    model: str,
    dataset: str | None,
    *,
    tokenizer: str | None = None,
    split: str | None = "train",
    eval_dataset: str | None = None,
    eval_split: str | None = None,
    adapter: str | None = None,
    inference_tokenizer: str | None = None,
    trust_remote_code: bool = False,
    weights: bool = True,
    base: str | None = None,
    vision: bool = False,
    held_out: bool = False,
) -> Setup:
    """The setup at these paths: config (and ``base``'s), adapter (checked), tokenizer, dataset, eval data,
    inference tokenizer.
    ``vision``: rows with pictures on a model with an image processor load its processor and stop there (TRL's
    trainer reads them); ``held_out``: the split defaults to test, else validation (``split=None``)."""
    from hf_sanity.measure.sources import load_config, load_dataset_ref, load_tokenizer

    started = time.perf_counter()
    config = load_config(model, trust_remote_code=trust_remote_code, weights=weights)
    if base:
        load_config(base, trust_remote_code=trust_remote_code)
    if adapter:  # an unreadable adapter fails now, not after the dataset is tokenized
        check_adapter(adapter)
    tok = load_tokenizer_of(model, tokenizer, trust_remote_code=trust_remote_code)
    setup = Setup(model, config, tok, None, trust_remote_code=trust_remote_code)

    def inference():
        if inference_tokenizer:
            setup.inference_tokenizer = load_tokenizer(
                inference_tokenizer, trust_remote_code=trust_remote_code, kind="inference tokenizer"
            )

    if held_out:  # outputs: the tokenizer it serves with before the prompts
        inference()
    if dataset is not None:
        setup.dataset = held_out_split(dataset, split) if held_out else load_dataset_ref(dataset, split)
    if vision:
        from hf_sanity.drivers.vlm import image_column, load_vision_processor

        setup.pictures = image_column(setup.dataset)
        if setup.pictures:
            setup.processor = load_vision_processor(model, trust_remote_code=trust_remote_code)
        if setup.processor is not None:
            setup.seconds = time.perf_counter() - started
            return setup
    if eval_dataset:
        setup.eval_dataset = load_dataset_ref(eval_dataset, eval_split or split)
    elif eval_split:
        setup.eval_dataset = load_dataset_ref(dataset, eval_split)
    if not held_out:
        inference()
    setup.seconds = time.perf_counter() - started
    return setup


def held_out_split(dataset: str, split: str | None):
    """The held-out split: ``split``, else ``test``, else ``validation`` (a single file is its one split)."""
    from hf_sanity.measure.sources import load_dataset_ref

    if split is not None:
        return load_dataset_ref(dataset, split)
    try:
        return load_dataset_ref(dataset, "test")
    except UserInputError as exc:
        if "has no split" not in str(exc):
            raise
        try:
            return load_dataset_ref(dataset, "validation")
        except UserInputError:
            raise UserInputError(
                f"dataset {dataset!r} has no test or validation split: pass --split with the held-out one"
            ) from None


def model_files(model: str) -> str | None:
    """The folder of the model's files: the folder given, or a hub id's snapshot in the local cache (its
    files are linked into a repaired copy, not downloaded and saved again); None when not cached."""
    if Path(model).expanduser().is_dir():
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception:  # not in the cache (or not a hub id): the model object is saved instead
        return None


def data_format(ref: str) -> str:
    """The format repaired data is written in: the format of ``ref`` (a hub id: Parquet, with its types)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        has_info = (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
        return "arrow" if has_info else "parquet"
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(suffix, "parquet")
