"""Loading what the user points at: a model, a tokenizer, a dataset. Bad input becomes one clear line.

Safe by default: ``trust_remote_code=False`` unless asked, weights from safetensors (or
``torch.load(weights_only=True)``, which transformers uses for ``.bin``), nothing written into the user's
folders.
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_sanity.errors import UserInputError

DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


def looks_local(ref: str) -> bool:
    """A path (exists, or is written like one) rather than a hub id like ``org/name``."""
    return (
        os.path.exists(ref)
        or ref.startswith((".", "/", "~"))
        or Path(ref).suffix in DATA_BUILDERS
        or ref.count("/") > 1
    )


def _missing(kind: str, ref: str) -> UserInputError:
    return UserInputError(f"{kind} {ref!r} does not exist; pass a local path or a hub id (org/name)")


def load_tokenizer(ref: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if looks_local(ref) and not os.path.exists(os.path.expanduser(ref)):
        raise _missing("tokenizer", ref)
    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(ref), trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise UserInputError(f"cannot load a tokenizer from {ref!r}: {_first_line(exc)}") from None


def _check_model_folder(ref: str) -> Path:
    path = Path(os.path.expanduser(ref))
    if looks_local(ref):
        if not path.exists():
            raise _missing("model", ref)
        if not path.is_dir():
            raise UserInputError(f"model {ref!r} is a file; pass the folder written by save_pretrained")
        if not any(any(path.glob(p)) for p in WEIGHT_PATTERNS):
            raise UserInputError(
                f"model folder {ref!r} has no weights (*.safetensors or pytorch_model.bin); "
                "pass the folder written by model.save_pretrained"
            )
    return path


def load_model(ref: str, *, dtype=None, trust_remote_code: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    path = _check_model_folder(ref)
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(path) if looks_local(ref) else ref,
            dtype=dtype or "auto",
            device_map="auto" if torch.cuda.is_available() else None,
            trust_remote_code=trust_remote_code,
        )
    except Exception as exc:
        raise UserInputError(f"cannot load a causal LM from {ref!r}: {_first_line(exc)}") from None


def load_dataset_ref(ref: str, split: str = "train"):
    """A local JSON/JSONL/CSV/Parquet file, a `save_to_disk` folder, a folder of data files, or a hub id."""
    import datasets

    was_enabled = not datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()  # "Generating train split" is noise in a report
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user as our one line
    try:
        return _load_dataset_ref(ref, split)
    finally:
        datasets.logging.set_verbosity(verbosity)
        if was_enabled:
            datasets.enable_progress_bars()


def _load_dataset_ref(ref: str, split: str):
    import datasets

    path = Path(os.path.expanduser(ref))
    try:
        if looks_local(ref):
            if not path.exists():
                raise _missing("dataset", ref)
            if path.is_file():
                builder = DATA_BUILDERS.get(path.suffix.lower())
                if builder is None:
                    raise UserInputError(
                        f"dataset {ref!r}: unknown file type {path.suffix!r}; use .json, .jsonl, .csv or .parquet"
                    )
                if path.stat().st_size == 0:
                    raise UserInputError(f"dataset {ref!r} is empty")
                return datasets.load_dataset(builder, data_files=str(path), split="train")
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
                loaded = datasets.load_from_disk(str(path))
            else:
                loaded = datasets.load_dataset(str(path))
        else:
            loaded = datasets.load_dataset(ref)
    except UserInputError:
        raise
    except Exception as exc:
        raise UserInputError(f"cannot read dataset {ref!r}: {_first_line(exc)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserInputError(
                f"dataset {ref!r} has no split {split!r}; it has {sorted(loaded)} (use --split)"
            )
        return loaded[split]
    return loaded


def _first_line(exc: BaseException) -> str:
    """The first line of the innermost cause: the library's wrapper exceptions say little."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_config(ref: str, *, trust_remote_code: bool = False):
    """The model's config, without its weights; a local folder must also hold weights (checked early, so a
    broken folder fails before any work is done)."""
    from transformers import AutoConfig

    path = _check_model_folder(ref)
    try:
        return AutoConfig.from_pretrained(
            str(path) if looks_local(ref) else ref, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise UserInputError(f"cannot read the model config of {ref!r}: {_first_line(exc)}") from None


def load_generation_config(ref: str):
    """The model folder's generation_config.json (how it stops when served), or None when it has none."""
    from transformers import GenerationConfig

    path = Path(os.path.expanduser(ref))
    if looks_local(ref) and not (path / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(str(path) if looks_local(ref) else ref)
    except Exception:  # unreadable or absent (offline hub id): the stop tokens are not known
        return None
