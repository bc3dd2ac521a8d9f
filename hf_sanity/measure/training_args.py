"""The fields of a ``training_args.bin`` (the TrainingArguments that Trainer pickles beside each checkpoint),
read without running any code of the file.

A pickle names classes and functions and asks the reader to call them; that is how a malicious file runs
code. This reader imports nothing and calls nothing the file names: every name becomes an inert record of
the arguments and state the file gives it. The fields come out as plain values (an enum as its value, a
nested dataclass as a dict); what cannot be read that way is not read (``None``), never loaded otherwise.
``torch.load(weights_only=True)`` is not used: it would need the real classes allow-listed (TrainingArguments,
its enums, accelerate's PartialState, ...), which differ between versions, and it imports torch.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

MAX_BYTES = 16 * 1024 * 1024  # a TrainingArguments pickle is a few kB
MAX_DEPTH = 8  # nested values deeper than this (or self-referencing) are cut


class _Record:
    """What a name in the pickle stands for: the arguments it was called with and the state it was given.
    Subclassed per name by :class:`_InertUnpickler`, so that ``NEWOBJ`` (which needs a class) works."""

    qualname = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        record = object.__new__(cls)
        record.args = args
        record.state = None
        return record

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the arguments are kept by __new__
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _InertUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._names: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        key = (module, name)
        if key not in self._names:
            self._names[key] = type(name, (_Record,), {"qualname": f"{module}.{name}"})
        return self._names[key]

    def persistent_load(self, pid: Any) -> Any:  # a tensor: no TrainingArguments field holds one
        raise pickle.UnpicklingError("tensor storage in a training_args.bin")


def _plain(value: Any, depth: int = 0) -> Any:
    """A JSON-like value: a record with state becomes its fields, one called with one argument that
    argument (an enum's value, a device's name), one with several the list of them."""
    if depth > MAX_DEPTH:
        return "..."
    if isinstance(value, _Record):
        state = value.state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
            state = state[0]  # (dict, slots)
        if isinstance(state, dict):
            return {str(k): _plain(v, depth + 1) for k, v in state.items()}
        if len(value.args) == 1:
            return _plain(value.args[0], depth + 1)
        return [_plain(v, depth + 1) for v in value.args] if value.args else value.qualname
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v, depth + 1) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def read_training_args_bin(path: Path) -> dict[str, Any] | None:
    """The fields of the TrainingArguments (or a subclass: Seq2SeqTrainingArguments, TRL's *Config) that
    ``torch.save`` wrote to ``path``; None when the file is not one."""
    try:
        with zipfile.ZipFile(path) as archive:  # torch.save's format since torch 1.6
            pickles = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
            if len(pickles) != 1 or pickles[0].file_size > MAX_BYTES:
                return None
            data = archive.read(pickles[0])
        top = _InertUnpickler(data).load()
    except Exception:  # not a zip, a legacy torch file, a broken pickle: not read
        return None
    if not isinstance(top, _Record) or not top.qualname.endswith(("TrainingArguments", "Config")):
        return None
    fields = _plain(top)
    if not isinstance(fields, dict):
        return None
    # hub_token and the like: secrets, never carried further (TrainingArguments.to_dict redacts them too)
    return {k: v for k, v in fields.items() if not k.endswith("_token")}
