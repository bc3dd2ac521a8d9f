"""The command's tracebacks as the command shows them without hf-sanity.

SanityCallback observes a step through a few wrappers that only pass the call on (the wrapped
``training_step`` and ``_get_grad_norm``, the first step's torch function mode): when the user's loss or the
framework's step raises inside one, the traceback goes through its frame, and a user reads hf-sanity in their
own crash. In a process whose trainer SanityCallback watches (``hf-sanity run -- CMD``, the frameworks' native
hooks, a callback the user attached) the uncaught exception is printed without those frames
(nothing else of it changes: the exception, its chain and every other frame), unless the error began in hf-sanity's
own code (then its traceback is shown whole).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import CodeType, TracebackType

PACKAGE = str(Path(__file__).resolve().parents[1])  # the hf_sanity folder
# (module, name): the functions of hf-sanity's wrappers that only call through to Trainer's, torch's or a framework's
PASS_THROUGH = {
    ("hf_sanity.training.instrument", "training_step"),
    ("hf_sanity.training.instrument", "_get_grad_norm"),
    ("hf_sanity.training.broadcast", "__torch_function__"),
    # Axolotl's preparation, counting the rows it drops for length (and keeping the count with its prepared rows)
    ("hf_sanity.integrations.axolotl_drops", "handle_long_seq_in_dataset"),
    ("hf_sanity.integrations.axolotl_drops", "save_preprocessed_dataset"),
    ("hf_sanity.integrations.axolotl_drops", "load_preprocessed_dataset"),
}


def pass_through_codes() -> set[CodeType]:
    """The code objects of :data:`PASS_THROUGH` among the modules loaded (nested functions included)."""
    found: set[CodeType] = set()
    for module_name in {m for m, _ in PASS_THROUGH}:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        names = {name for m, name in PASS_THROUGH if m == module_name}
        stack = [v.__code__ for v in _functions(vars(module).values())]
        while stack:
            code = stack.pop()
            if code.co_name in names:
                found.add(code)
            stack.extend(c for c in code.co_consts if isinstance(c, CodeType))
    return found


def _functions(values):
    for value in values:
        if hasattr(value, "__code__"):
            yield value
        elif isinstance(value, type):
            yield from (v for v in vars(value).values() if hasattr(v, "__code__"))


def without_pass_through(tb: TracebackType | None, codes: set[CodeType]) -> TracebackType | None:
    """``tb`` without the pass-through frames that passed the error on from code that is not hf-sanity's (the
    user's, the framework's, torch's); one that called into hf-sanity's own code stays (its error is shown
    whole)."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    dropped = {
        i
        for i, e in enumerate(entries)
        if e.tb_frame.f_code in codes and (i + 1 == len(entries) or not _ours(entries[i + 1]))
    }
    for i in sorted(dropped):
        if _torch_dispatch(entries, i):  # the op entered twice because a mode is on: its first entry goes too
            dropped |= {i - 1, i - 2}
    kept = [e for i, e in enumerate(entries) if i not in dropped]
    for entry, following in zip(kept, [*kept[1:], None]):
        entry.tb_next = following
    return kept[0] if kept else None


def _ours(entry: TracebackType) -> bool:
    return str(Path(entry.tb_frame.f_code.co_filename).resolve()).startswith(PACKAGE + "/")


def _torch_dispatch(entries: list[TracebackType], i: int) -> bool:
    """Whether the pass-through frame ``i`` (the torch function mode's) was reached through torch's Python
    dispatch: ``op -> torch.overrides.handle_torch_function -> the mode -> op`` where, without a mode, torch
    runs ``op`` once."""
    if i < 2 or i + 1 >= len(entries):
        return False
    dispatch, op = entries[i - 1].tb_frame.f_code, entries[i - 2].tb_frame.f_code
    return (
        dispatch.co_name == "handle_torch_function"
        and dispatch.co_filename.endswith(("torch/overrides.py", "torch\\overrides.py"))
        and op is entries[i + 1].tb_frame.f_code
    )


def clean(exc: BaseException) -> None:
    """Unlink the pass-through frames from ``exc`` and the exceptions it was raised from or during."""
    codes = pass_through_codes()
    seen: set[int] = set()
    while codes and exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = without_pass_through(exc.__traceback__, codes)
        exc = exc.__cause__ or exc.__context__


def install() -> None:
    """Print uncaught exceptions through :func:`clean` (then as before: Python's hook, or the one in place); once
    per process, whoever asks first (the launch's hook, or SanityCallback when it wraps a trainer's step)."""
    shown = sys.excepthook
    if getattr(shown, "hf_sanity_cleans", False):
        return

    def excepthook(kind, exc, tb):
        try:
            exc.__traceback__ = tb
            clean(exc)
            tb = exc.__traceback__
        except Exception:
            pass
        shown(kind, exc, tb)

    excepthook.hf_sanity_cleans = True
    sys.excepthook = excepthook
