"""The rows Axolotl drops before any trainer exists, counted where it drops them.

With ``excess_length_strategy: drop`` (its default) Axolotl's data preparation
(``axolotl.utils.data.utils.handle_long_seq_in_dataset``) filters out every row longer than ``sequence_len``, logs
one line ("Dropped N sequences outside valid range") and goes on; the trainer, and SanityCallback, only ever see
the rows kept. :func:`watch_preparation` (called by the Axolotl plugin's ``register``, and by the import hook of
``hf-sanity run``/``preflight -- axolotl ...``) wraps that function where Axolotl's SFT preparation calls it; the
wrapper counts the training rows it got longer than the cut and the rows it returned (:func:`counted_drop`), and
records them for ``truncated-completion`` (:func:`hf_sanity.measure.frameworks.record_prepared_drop`).

The wrapper only passes the call on: Axolotl's result and errors are its own. Where Axolotl's internals differ
(another version), one line says the count is missing and the run goes on. A prepared dataset Axolotl loads from
its ``dataset_prepared_path`` was filtered when it was prepared: nothing is counted then. This module imports
nothing of Axolotl's (the hook may call it while Axolotl is still importing transformers).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Sequence
from typing import Any

# Where Axolotl 0.19 drops (or cuts) the rows longer than `sequence_len`, and the module of its SFT preparation
# that imported it by name (the name the call goes through).
LENGTH_HANDLER = "handle_long_seq_in_dataset"
DEFINED_IN = "axolotl.utils.data.utils"
CALLED_FROM = "axolotl.utils.data.sft"
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
                record_prepared_drop(
                    counted_drop(
                        before, len(result), int(bound["sequence_len"]), cfg.get("excess_length_strategy")
                    )
                )
            except Exception as exc:
                say(NO_COUNT.format(why=f"{type(exc).__name__}: {exc}"))
        return result

    handle_long_seq_in_dataset.counts_for_hf_sanity = True
    return handle_long_seq_in_dataset


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
