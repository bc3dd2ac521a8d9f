"""The rows Axolotl drops before any trainer exists, counted where it drops them.

With ``excess_length_strategy: drop`` (its default) Axolotl's data preparation
(``axolotl.utils.data.utils.handle_long_seq_in_dataset``) filters out every row longer than ``sequence_len``, logs
one line ("Dropped N sequences outside valid range") and goes on; the trainer, and SanityCallback, only ever see
the rows kept. :func:`watch_preparation` (called by the Axolotl plugin's ``register``, and by the import hook of
``hf-sanity run``/``preflight -- axolotl ...``) wraps that function where Axolotl's SFT preparation calls it; the
wrapper counts the training rows it got longer than the cut and the rows it returned (:func:`counted_drop`), and
records them for ``truncated-completion`` (:func:`hf_sanity.measure.frameworks.record_prepared_drop`).

Axolotl saves the rows it prepared under its ``dataset_prepared_path`` (by a hash of the config's data settings,
``sequence_len`` among them) and a later run with the same settings, or ``axolotl train`` after ``axolotl
preprocess``, loads them without preparing them again: the count is kept beside hf-sanity's other files
(``$HF_SANITY_CACHE/axolotl-drops/HASH.json``, written when Axolotl saves the rows) and recalled when Axolotl loads
them (``save_preprocessed_dataset``, ``load_preprocessed_dataset``, wrapped the same way), if the rows loaded are
as many as were saved.

The wrappers only pass the call on: Axolotl's result and errors are its own. Where Axolotl's internals differ
(another version), one line says the count is missing and the run goes on. This module imports nothing of
Axolotl's (the hook may call it while Axolotl is still importing transformers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Where Axolotl 0.19 drops (or cuts) the rows longer than `sequence_len`, and the module of its SFT preparation
# that imported it by name (the name the call goes through).
LENGTH_HANDLER = "handle_long_seq_in_dataset"
DEFINED_IN = "axolotl.utils.data.utils"
CALLED_FROM = "axolotl.utils.data.sft"
# Where the same module saves the rows it prepared, and loads them from an earlier preparation.
SAVE, LOAD = "save_preprocessed_dataset", "load_preprocessed_dataset"
NO_COUNT = (
    "cannot count the rows Axolotl drops for being longer than sequence_len ({why}); the run goes on, and the "
    "report does not say how many"
)


def say(line: str) -> None:
    """One line on stderr (this module imports nothing heavy: not the launch hook's ``say``)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(f"hf-sanity: {line}\n")
        sys.stderr.flush()


def counted_drop(
    lengths: Sequence[int], kept: int, sequence_len: int, strategy: str | None
) -> Any:  # frameworks.PreparedDrop
    """What one pass of Axolotl's length handling dropped: of the rows of token ``lengths`` it got, the ones
    longer than ``sequence_len`` (which ``strategy`` "drop", Axolotl's default when unset, filters out), against
    the ``kept`` rows it returned."""
    from hf_sanity.measure.frameworks import AXOLOTL, PreparedDrop

    longer = [n for n in lengths if n > sequence_len]
    return PreparedDrop(
        framework=AXOLOTL.name,
        rows_prepared=len(lengths),
        rows_kept=kept,
        too_long=len(longer) if len(lengths) > kept else 0,  # truncate, raise: nothing dropped for length
        cut=sequence_len,
        strategy=(strategy or "drop").lower(),
        strategy_set=strategy is not None,
        longest=max(longer) if longer and len(lengths) > kept else None,
    )


def row_lengths(dataset) -> list[int] | None:
    """The token count of each row of a tokenized ``datasets.Dataset`` (its ``input_ids`` lists, read from the
    Arrow offsets, no row decoded), or None where it is not one (streamed, no ``input_ids``: Axolotl skips those
    too)."""
    names = getattr(dataset, "column_names", None)
    if not hasattr(dataset, "__len__") or not names or "input_ids" not in names:
        return None
    import pyarrow.compute as pc

    table = dataset.select_columns(["input_ids"]).with_format("arrow")[:]
    return pc.list_value_length(table.column("input_ids")).to_pylist()


def memory_dir() -> Path:
    """Where the counts of preparations Axolotl saved are kept (hf-sanity's cache, never Axolotl's folder)."""
    from hf_sanity.cache import cache_root

    return cache_root() / "axolotl-drops"


def remember(dataset_hash: str, drop, saved_rows: int) -> None:
    """Keep the count of the preparation Axolotl saved under ``dataset_hash`` (``saved_rows`` rows)."""
    folder = memory_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dataset_hash}.json"
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"saved_rows": saved_rows, "drop": dataclasses.asdict(drop)}))
    partial.replace(path)  # whole or not at all: another process may read it


def recalled(dataset_hash: str, loaded_rows: int):
    """The count kept for the preparation Axolotl saved under ``dataset_hash``, marked as counted earlier; None
    where none is kept or the rows loaded are not as many as were saved (prepared again without hf-sanity)."""
    from hf_sanity.measure.frameworks import PreparedDrop

    path = memory_dir() / f"{dataset_hash}.json"
    if not path.is_file():
        return None
    kept = json.loads(path.read_text())
    if kept.get("saved_rows") != loaded_rows:
        return None
    return dataclasses.replace(PreparedDrop(**kept["drop"]), prepared_earlier=True)


_unsaved: list = []  # the training split's count, until Axolotl saves the rows it kept


def _counting(handler):
    """``handler`` (Axolotl's ``handle_long_seq_in_dataset(dataset, sequence_len, cfg)``), counting what it drops
    from the training rows."""
    import inspect

    signature = inspect.signature(handler)
    calls = []  # Axolotl prepares the training split first, then the test split (`test_datasets`)

    @functools.wraps(handler)
    def handle_long_seq_in_dataset(*args, **kwargs):
        before = None
        try:
            bound = signature.bind(*args, **kwargs).arguments
            split = sys._getframe(1).f_locals.get("split")  # its caller's (`_load_raw_datasets(..., split)`)
            split = split if split in ("train", "test") else "train" if not calls else "test"
            calls.append(split)
            if split == "train":
                before = row_lengths(bound["dataset"])
        except Exception as exc:
            say(NO_COUNT.format(why=f"{type(exc).__name__}: {exc}"))
        result = handler(*args, **kwargs)  # Axolotl's own call: its result and its errors, untouched
        if before is not None:
            try:
                from hf_sanity.measure.frameworks import record_prepared_drop

                cfg = bound["cfg"]
                strategy = cfg.get("excess_length_strategy")
                drop = counted_drop(before, len(result), int(bound["sequence_len"]), strategy)
                record_prepared_drop(drop)
                _unsaved[:] = [drop]
            except Exception as exc:
                say(NO_COUNT.format(why=f"{type(exc).__name__}: {exc}"))
        return result

    handle_long_seq_in_dataset.counts_for_hf_sanity = True
    return handle_long_seq_in_dataset


def _remembering(save):
    """``save`` (Axolotl's ``save_preprocessed_dataset(cfg, dataset, dataset_hash, split)``), keeping the count of
    the training rows it saves."""
    import inspect

    signature = inspect.signature(save)

    @functools.wraps(save)
    def save_preprocessed_dataset(*args, **kwargs):
        result = save(*args, **kwargs)  # Axolotl's own call
        if _unsaved:
            try:
                bound = signature.bind(*args, **kwargs).arguments
                if bound["split"] == "train":
                    remember(str(bound["dataset_hash"]), _unsaved.pop(), len(bound["dataset"]))
            except Exception as exc:
                say(f"could not keep the count of the rows Axolotl dropped ({type(exc).__name__}: {exc})")
        return result

    save_preprocessed_dataset.counts_for_hf_sanity = True
    return save_preprocessed_dataset


def _recalling(load):
    """``load`` (Axolotl's ``load_preprocessed_dataset(cfg, dataset_hash)``), recalling the count kept for the
    training rows it loads."""
    import inspect

    signature = inspect.signature(load)

    @functools.wraps(load)
    def load_preprocessed_dataset(*args, **kwargs):
        result = load(*args, **kwargs)  # Axolotl's own call
        if result is not None:
            try:
                # its caller's split (`_load_tokenized_prepared_datasets(..., split)`)
                split = sys._getframe(1).f_locals.get("split")
                if split in ("train", None) and hasattr(result, "__len__"):
                    from hf_sanity.measure import frameworks

                    # An earlier count of this process (another config) must not stand for these rows.
                    frameworks.forget_prepared_drops(frameworks.AXOLOTL)
                    dataset_hash = str(signature.bind(*args, **kwargs).arguments["dataset_hash"])
                    drop = recalled(dataset_hash, len(result))
                    if drop is not None:
                        frameworks.record_prepared_drop(drop)
            except Exception as exc:
                say(f"could not recall the count of the rows Axolotl dropped ({type(exc).__name__}: {exc})")
        return result

    load_preprocessed_dataset.counts_for_hf_sanity = True
    return load_preprocessed_dataset


def watch_preparation() -> None:
    """Count what Axolotl's length handling drops: now, where its SFT preparation is loaded, else once it loads
    (nothing of Axolotl is imported here: this may run while Axolotl is still importing transformers). Never
    raises."""
    try:
        if CALLED_FROM in sys.modules:
            _wrap()
        elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
    except Exception as exc:
        say(NO_COUNT.format(why=f"{type(exc).__name__}: {exc}"))


def _wrap() -> None:
    caller, defining = sys.modules[CALLED_FROM], sys.modules.get(DEFINED_IN)
    handler = getattr(caller, LENGTH_HANDLER, None)
    if getattr(handler, "counts_for_hf_sanity", False):
        return
    if not callable(handler):
        say(NO_COUNT.format(why=f"{CALLED_FROM} has no {LENGTH_HANDLER}: another Axolotl than 0.19"))
        return
    counting = _counting(handler)
    setattr(caller, LENGTH_HANDLER, counting)
    if defining is not None and getattr(defining, LENGTH_HANDLER, None) is handler:
        setattr(defining, LENGTH_HANDLER, counting)
    # Without these only the runs that prepare their rows are counted (the first, not the ones after it).
    for name, wrapper in ((SAVE, _remembering), (LOAD, _recalling)):
        function = getattr(caller, name, None)
        if callable(function) and not getattr(function, "counts_for_hf_sanity", False):
            setattr(caller, name, wrapper(function))


class _AfterImport:
    """A one-shot meta-path finder: it finds Axolotl's SFT preparation module as the finders after it would,
    and wraps its length handler once the module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != CALLED_FROM:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = None
        for finder in list(sys.meta_path):
            if hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            say(NO_COUNT.format(why=f"{CALLED_FROM} loads in a way hf-sanity cannot follow"))
            return spec
        run_module = loader.exec_module

        def exec_module(module):
            run_module(module)  # Axolotl's module itself, unchanged
            vars(loader).pop("exec_module", None)
            try:
                _wrap()
            except Exception as exc:
                say(NO_COUNT.format(why=f"{type(exc).__name__}: {exc}"))

        loader.exec_module = exec_module  # this module's own loader object only
        return spec
