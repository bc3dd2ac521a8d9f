"""Loading what the user points at: a model, a tokenizer, a dataset. Bad input becomes one clear line.

Safe by default: ``trust_remote_code=False`` unless asked, weights from safetensors (or
``torch.load(weights_only=True)``, which transformers uses for ``.bin``), nothing written into the user's
folders.
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_sanity import progress
from hf_sanity.errors import UserInputError

DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
# A folder holds a tokenizer when it has its vocabulary in one of these forms (fast, SentencePiece, BPE,
# WordPiece, tiktoken, Mistral's tekken).
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer.model", "*.model", "vocab.json", "vocab.txt", "*.tiktoken",
                      "tekken.json")  # fmt: skip


def looks_local(ref: str) -> bool:
    """A path (exists, or is written like one) rather than a hub id like ``org/name``."""
    return (
        os.path.exists(ref)
        or ref.startswith((".", "/", "~"))
        or Path(ref).suffix in DATA_BUILDERS
        or ref.count("/") > 1
    )


def missing_path(kind: str, ref: str) -> UserInputError:
    return UserInputError(f"{kind} {ref!r} does not exist; pass a local path or a hub id (org/name)")


OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def _unreachable(kind: str, ref: str, exc: BaseException) -> UserInputError | None:
    """A reference that is neither here nor fetchable from the hub, in words (the hub library speaks of disk
    caches and outgoing traffic); None for any other failure."""
    chain = []
    while exc is not None and len(chain) < 10:
        chain.append(exc)
        exc = exc.__cause__ or (exc.__context__ if not exc.__suppress_context__ else None)
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e) for e in chain)
    here = f"{kind} {ref!r}: there is no file or folder {str(Path(ref).expanduser().absolute())!r}"
    offline = names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled"} or any(
        marker in text for marker in ("outgoing traffic has been disabled", "OfflineModeIsEnabled")
    )
    if offline:
        switches = [
            v for v in OFFLINE_SWITCHES if os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
        ]
        why = f"{switches[0]} is set" if switches else "the hub cannot be reached"
        return UserInputError(
            f"{here}, and as a hub id it is not in the local hub cache and cannot be fetched ({why}); check the "
            "path, or download it once online"
        )
    if names & {"RepositoryNotFoundError", "DatasetNotFoundError", "GatedRepoError"} or (
        "is not a valid model identifier" in text
    ):
        return UserInputError(f"{here}, and no hub repository of that name is available (a typo, or private)")
    return None


@progress.phase("loading the tokenizer")
def load_tokenizer(ref: str, *, trust_remote_code: bool = False, kind: str = "tokenizer"):
    """The tokenizer at ``ref``; ``kind`` names where the reference came from (``model`` when the tokenizer is
    read from the model folder)."""
    from transformers import AutoTokenizer

    path = Path(os.path.expanduser(ref))
    if looks_local(ref) and not path.exists():
        raise missing_path(kind, ref)
    if path.is_dir() and not any(any(path.glob(p)) for p in TOKENIZER_PATTERNS):
        hint = (
            "pass --tokenizer with the tokenizer's folder or hub id"
            if kind == "model"
            else "pass the folder the tokenizer was saved to (tokenizer.save_pretrained)"
        )
        raise UserInputError(
            f"{kind} folder {ref!r} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json + "
            f"merges.txt, vocab.txt or *.tiktoken); {hint}"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise _unreachable(kind, ref, exc) or UserInputError(
            f"cannot load a tokenizer from {ref!r}: {_first_line(exc)}"
        ) from None


def check_model_folder(ref: str, weights: bool = True) -> Path:
    path = Path(os.path.expanduser(ref))
    if looks_local(ref):
        if not path.exists():
            raise missing_path("model", ref)
        if not path.is_dir():
            raise UserInputError(f"model {ref!r} is a file; pass the folder written by save_pretrained")
        if weights and not any(any(path.glob(p)) for p in WEIGHT_PATTERNS):
            raise UserInputError(
                f"model folder {ref!r} has no weights (*.safetensors or pytorch_model.bin); "
                "pass the folder written by model.save_pretrained"
            )
    return path


@progress.phase("loading the model")
def load_model(ref: str, *, dtype=None, trust_remote_code: bool = False):
    """A causal LM, or a vision-language model (image-text-to-text) whose config no causal LM class takes."""
    import torch
    from transformers import AutoModelForCausalLM

    path = check_model_folder(ref)
    try:
        auto = _vision_language_class(path, trust_remote_code) or AutoModelForCausalLM
        return auto.from_pretrained(
            str(path) if looks_local(ref) else ref,
            dtype=dtype or "auto",
            device_map="auto" if torch.cuda.is_available() else None,
            trust_remote_code=trust_remote_code,
        )
    except Exception as exc:
        raise _unreachable("model", ref, exc) or UserInputError(
            f"cannot load a causal LM from {ref!r}: {_first_line(exc)}"
        ) from None


def _vision_language_class(path: Path, trust_remote_code: bool):
    """AutoModelForImageTextToText for a local folder whose config is a vision-language one (LLaVA, Idefics3:
    transformers maps them to no causal LM class); else None."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if not path.is_dir() or not (path / "config.json").is_file():
        return None
    model_type = getattr(
        AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code), "model_type", None
    )
    if (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or model_type not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        return None
    return AutoModelForImageTextToText


@progress.phase("loading the dataset")
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


def check_dataset_path(ref: str) -> Path:
    """The path of a local dataset that exists and, as a file, is of a known type and not empty (one line
    otherwise, from the file system alone: called before any heavy import too)."""
    path = Path(os.path.expanduser(ref))
    if looks_local(ref):
        if not path.exists():
            raise missing_path("dataset", ref)
        if path.is_file():
            if DATA_BUILDERS.get(path.suffix.lower()) is None:
                raise UserInputError(
                    f"dataset {ref!r}: unknown file type {path.suffix!r}; use .json, .jsonl, .csv or .parquet"
                )
            if path.stat().st_size == 0:
                raise UserInputError(f"dataset {ref!r} is empty")
    return path


def _load_dataset_ref(ref: str, split: str):
    import datasets

    try:
        path = check_dataset_path(ref)
        if looks_local(ref):
            if path.is_file():
                builder = DATA_BUILDERS[path.suffix.lower()]
                if builder in TEXT_BUILDERS:
                    check_utf8(path, ref)
                try:
                    return datasets.load_dataset(builder, data_files=str(path), split="train")
                except Exception:
                    problem = json_problem(path) if builder == "json" else None
                    if problem:
                        raise UserInputError(f"cannot read dataset {ref!r}: {problem}") from None
                    raise
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
                loaded = datasets.load_from_disk(str(path))
            else:
                for data_file in sorted(path.rglob("*")):
                    if DATA_BUILDERS.get(data_file.suffix.lower()) in TEXT_BUILDERS and data_file.is_file():
                        check_utf8(data_file, str(data_file))
                loaded = datasets.load_dataset(str(path))
        else:
            loaded = datasets.load_dataset(ref)
    except UserInputError:
        raise
    except Exception as exc:
        unreachable = None if looks_local(ref) else _unreachable("dataset", ref, exc)
        raise unreachable or UserInputError(f"cannot read dataset {ref!r}: {_first_line(exc)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserInputError(
                f"dataset {ref!r} has no split {split!r}; it has {sorted(loaded)} (use --split)"
            )
        return loaded[split]
    return loaded


TEXT_BUILDERS = ("json", "csv")  # read as UTF-8 text (pyarrow's JSON reader takes invalid bytes in silently)


def check_utf8(path: Path, ref: str) -> None:
    """Bad input when the file is not UTF-8: the byte offset and line of the first invalid byte. pyarrow's JSON
    reader loads invalid bytes without a word and the first row read that holds one raises deep inside it."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            pending = len(decoder.getstate()[0])  # the start of a character cut by the previous chunk
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:  # exc.object: the pending bytes, then this chunk
                where = offset - pending + exc.start
                line += exc.object.count(b"\n", 0, exc.start)
                raise UserInputError(
                    f"dataset {ref!r} is not UTF-8: byte {where} (line {line}) is {exc.object[exc.start]:#04x}; "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            offset += len(chunk)
            line += chunk.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise UserInputError(
            f"dataset {ref!r} is not UTF-8: it ends inside a multi-byte character (byte {offset}); re-encode the "
            "file as UTF-8"
        ) from None


def as_dataset(data, what: str = "dataset"):
    """``data`` as a ``datasets.Dataset``: a Dataset as is; a list of row dicts (the rows the README's examples
    build) or a pandas DataFrame converted; bad input otherwise."""
    import datasets

    if isinstance(data, datasets.DatasetDict):
        raise UserInputError(
            f"{what} is a DatasetDict with splits {sorted(data)}; pass one split, e.g. {what}['train']"
        )
    if isinstance(data, (list, tuple)):
        if not data:
            raise UserInputError(f"{what} is an empty list")
        if not all(isinstance(row, dict) for row in data):
            bad = next(i for i, row in enumerate(data) if not isinstance(row, dict))
            raise UserInputError(f"{what} row {bad} is a {type(data[bad]).__name__}; pass rows as dicts")
        try:
            return datasets.Dataset.from_list(list(data))
        except Exception as exc:  # rows whose columns do not fit one table
            raise UserInputError(f"cannot make a dataset of the {what} rows: {_first_line(exc)}") from None
    if type(data).__name__ == "DataFrame" and hasattr(data, "to_dict"):  # pandas, not imported for the check
        return datasets.Dataset.from_pandas(data, preserve_index=False)
    if not isinstance(data, datasets.Dataset):
        raise UserInputError(
            f"{what} is a {type(data).__name__}; pass a datasets.Dataset or a list of rows (dicts)"
        )
    return data


def json_problem(path: Path) -> str | None:
    """Where a JSON Lines (or JSON) file stops being readable, by line number; None when every line parses
    (the problem is elsewhere)."""
    import json

    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                if number == 1 and path.suffix.lower() == ".json":  # one JSON document, not JSON Lines
                    return _document_problem(path)
                return f"line {number} is not valid JSON ({exc.msg}, column {exc.colno})"
            if not isinstance(value, dict):
                return f"line {number} is a JSON {type(value).__name__}, not an object (one row per line)"
    return None


def _document_problem(path: Path) -> str | None:
    import json

    try:
        json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as exc:
        return f"line {exc.lineno} is not valid JSON ({exc.msg}, column {exc.colno})"
    return None


def _first_line(exc: BaseException) -> str:
    """The first line of the innermost cause: the library's wrapper exceptions say little."""
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_config(ref: str, *, trust_remote_code: bool = False, weights: bool = True):
    """The model's config, without its weights; a local folder must also hold weights unless ``weights`` is
    False (checked early, so a broken folder fails before any work is done)."""
    from transformers import AutoConfig

    path = check_model_folder(ref, weights)
    try:
        return AutoConfig.from_pretrained(
            str(path) if looks_local(ref) else ref, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise _unreachable("model", ref, exc) or UserInputError(
            f"cannot read the model config of {ref!r}: {_first_line(exc)}"
        ) from None


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
