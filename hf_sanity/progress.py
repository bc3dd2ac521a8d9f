"""Progress of long work, shown while it runs. Plain code reports what it is doing::

    with progress.phase("tokenizing", total=len(rows)):
        for batch in batches:
            ...
            progress.advance(len(batch))

and stays plain: every call is a no-op unless a display is on (:func:`enable`), which the CLI turns on only
when stderr is a terminal. A long command whose stderr is not a terminal (`overfit`, `diagnose` in a job's log)
gets one plain line per phase instead (``lines=True``); other piped runs, ``--json -`` and the Python API print
nothing extra, and stdout is never touched. Phases nest (``advance`` and ``describe`` act on the innermost); each is drawn as soon as it opens; the
display starts with the first phase and is cleared by :func:`disable`, before the report prints.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

_console: Any = None  # where the display goes once enabled; None: every call below is a no-op
_live: Any = None  # the rich Progress, started by the first phase
_open: list[tuple[Any, str]] = []  # (task id, name) of the open phases, innermost last
_lines: Any = None  # where one plain line per phase goes when no display is on (stderr not a terminal)


def active() -> bool:
    """A display is on (e.g. to keep a library's own progress bar from drawing over it)."""
    return _console is not None


@contextlib.contextmanager
def phase(name: str, total: int | None = None) -> Iterator[None]:
    """One step of the work, shown with its name (and ``advance``'s count of ``total``) while the block runs."""
    if _lines is not None:
        _say(name, total)
    live = _start() if _console is not None else None
    if live is None:
        yield
        return
    task = _quietly(live.add_task, name, total=total)
    _open.append((task, name))
    _quietly(live.refresh)  # drawn now, however short the phase
    try:
        yield
    finally:
        if (task, name) in _open:
            _open.remove((task, name))
        _quietly(live.remove_task, task)


def advance(n: float = 1) -> None:
    """``n`` more units of the innermost phase done."""
    if _live is not None and _open:
        _quietly(_live.advance, _open[-1][0], n)


def describe(detail: str) -> None:
    """What the innermost phase is on now (the check that runs, the learning rate tried)."""
    if _live is not None and _open:
        task, name = _open[-1]
        _quietly(_live.update, task, description=f"{name}: {detail}")


def each(items, detail=None) -> Iterator[Any]:
    """``items`` one by one, the innermost phase advanced after each (``detail(item)``: shown while it runs)."""
    for item in items:
        if detail is not None and _live is not None:
            describe(detail(item))
        yield item
        advance()


def wanted(stream=None) -> bool:
    """Whether a command should show progress: its stderr is a terminal, and it is the main process of a
    ``torchrun`` (the other ranks' stderr is the same terminal)."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
    return tty and os.environ.get("RANK", "0") == "0" and os.environ.get("TERM") != "dumb"


def enable(console=None, *, enabled: bool | None = None, lines: bool = False) -> bool:
    """Show the phases from now on, on ``console`` (default: a rich console on stderr), when ``enabled``
    (default: :func:`wanted`); where not, and ``lines``, one plain line per phase on stderr (the main process
    only). Returns whether the display is on."""
    global _console, _lines
    if _console is None and (wanted() if enabled is None else enabled):
        from rich.console import Console

        _console = console or Console(stderr=True)
    elif _console is None and lines and os.environ.get("RANK", "0") == "0":
        _lines = sys.stderr
    return _console is not None


def _say(name: str, total: int | None) -> None:
    with contextlib.suppress(Exception):  # a closed or broken stream never stops the work
        _lines.write(f"hf-sanity: {name}" + (f" ({total})" if total else "") + "\n")
        _lines.flush()


def disable() -> None:
    """Clear the display (nothing of it stays on the terminal) and show nothing more."""
    global _console, _live, _lines
    live, _console, _live, _lines = _live, None, None, None
    _open.clear()
    if live is not None:
        with contextlib.suppress(Exception):
            live.stop()


@contextlib.contextmanager
def display(console=None, *, enabled: bool | None = None) -> Iterator[None]:
    """:func:`enable` for the block's duration."""
    was = _console is not None
    enable(console, enabled=enabled)
    try:
        yield
    finally:
        if not was:
            disable()


def _start():
    global _live
    if _live is None:
        from rich.progress import (
            BarColumn,
            Progress,
            ProgressColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.text import Text

        class Count(ProgressColumn):
            def render(self, task) -> Text:  # "3/40", nothing for a phase without a total
                shown = "" if task.total is None else f"{int(task.completed)}/{int(task.total)}"
                return Text(shown, style="progress.download")

        live = Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(bar_width=24),
            Count(),
            TimeElapsedColumn(),
            console=_console,
            transient=True,
            refresh_per_second=5,  # a terminal line, not an animation: fewer redraws, less of the work's time
            redirect_stdout=False,  # stdout stays the report's (``--json -``)
            redirect_stderr=True,  # a warning printed meanwhile goes above the display, not through it
        )
        _quietly(live.start)
        _live = live
    return _live


def _quietly(call, *args, **kwargs):
    """A display problem never becomes the work's."""
    try:
        return call(*args, **kwargs)
    except Exception:
        return None
