"""In each process of the command: the callback every Trainer gets at construction, and what it does per mode.

:func:`install` (called by the bootstrap once ``transformers.trainer`` has loaded) appends :class:`HfSanityLaunch`
to ``transformers.trainer.DEFAULT_CALLBACKS``, the list every ``Trainer.__init__`` (TRL's trainers' and any
subclass's included) starts its callbacks from. Nothing wraps ``__init__`` or ``train``: an error in the user's
code or the framework's raises through their own frames only. In Axolotl's command it also counts the rows
Axolotl's data preparation drops for length, before any trainer exists
(:mod:`hf_sanity.integrations.axolotl_drops`). One anchor per trainer, right after Trainer's
``DefaultFlowCallback``:

* ``run``: at the end of ``__init__`` it attaches ``SanityCallback`` with the options the parent passed, unless
  the trainer has one already (the user's is respected, and is the one reported; one added later, before
  ``train()``, replaces hf-sanity's); at train end, and again at exit (a run that died), the main process
  sends the report to the parent (:mod:`hf_sanity.launch.protocol`).
* ``preflight``: the trainer's ``train`` becomes :meth:`HfSanityLaunch.preflight` (an attribute of that one
  object): the checks run on the trainer as the command built it, rank 0 sends the report, the folders
  ``Trainer.__init__`` created and left empty (its ``output_dir``) are removed, and the process ends there,
  before anything of ``train()`` or of the command after it runs.

Whatever fails here is one line on stderr (``hf-sanity: ...``) and the command goes on as without hf-sanity.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

from transformers.trainer_callback import TrainerCallback

from hf_sanity.launch import protocol

_settings: protocol.Settings | None = None
_anchors: list[HfSanityLaunch] = []  # this process's trainers, in the order they were built
_said: set[str] = set()


def say(line: str) -> None:
    """One line on stderr, once per process."""
    if line not in _said:
        _said.add(line)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"hf-sanity: {line}\n")
            sys.stderr.flush()


@contextlib.contextmanager
def unbreakable(what: str):
    """Nothing hf-sanity does may stop the command: an exception is one line, and the command goes on."""
    try:
        yield
    except Exception as exc:
        say(f"could not {what} ({type(exc).__name__}: {exc}); the command goes on unwatched")


def install(trainer_module) -> None:
    """Give every Trainer built from now on an :class:`HfSanityLaunch` (once per process)."""
    global _settings
    try:
        _settings = protocol.Settings.from_env()
    except ValueError as exc:
        say(f"{exc}: run the command with the hf-sanity it was started by; it runs unwatched")
        return
    defaults = getattr(trainer_module, "DEFAULT_CALLBACKS", None)
    if _settings is None or not isinstance(defaults, list):
        return
    if not any(getattr(cb, "__name__", None) == HfSanityLaunch.__name__ for cb in defaults):
        from hf_sanity.launch import tracebacks

        defaults.append(HfSanityLaunch)
        atexit.register(_at_exit, os.getpid())
        tracebacks.install()  # the user's crash shows without the callback's pass-through frames
        if "axolotl" in sys.modules:  # Axolotl's command: the rows its data preparation drops, counted
            from hf_sanity.integrations.axolotl_drops import watch_preparation

            watch_preparation()


def building_trainer():
    """The Trainer whose ``__init__`` is on the stack (it builds its callback handler, which builds us)."""
    from transformers.trainer import Trainer

    frame = sys._getframe(1)
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
    finally:
        del frame
    return None


def _rank(trainer) -> tuple[int, int]:
    args = trainer.args
    return int(getattr(args, "process_index", 0) or 0), int(getattr(args, "world_size", 1) or 1)


def watcher(trainer):
    """The SanityCallback that watches ``trainer`` (hf-sanity's or the user's), or None."""
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        if type(callback).__name__ == "SanityCallback":
            return callback
    return None


class HfSanityLaunch(TrainerCallback):
    """hf-sanity's anchor in a trainer of a command run by ``hf-sanity run``/``preflight -- CMD``."""

    def __init__(self) -> None:
        self.trainer = building_trainer()
        self.settings = _settings
        self.n = len(_anchors)
        self.sanity = None  # the SanityCallback watching the trainer
        self.added: Any = None  # the one hf-sanity added (None: the user's, or none)
        self.started: float | None = None
        self.folders = None
        if self.trainer is None or self.settings is None:
            return
        _anchors.append(self)
        if self.settings.mode == "preflight":  # before Trainer.__init__ creates its output_dir
            with unbreakable("note what the trainer's output_dir holds"):
                self.folders = Folders(self.trainer.args.output_dir)

    # -- Trainer events ------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        if self.trainer is None or self.settings is None:
            return control
        with unbreakable("attach to " + type(self.trainer).__name__):
            if self.settings.mode == "run":
                self._attach()
            else:
                self.trainer.train = self.preflight  # this trainer object only; the class is left alone
            rank, world = _rank(self.trainer)
            protocol.send(
                protocol.record_path(self.settings.exchange, "attached", self.n),
                {"pid": os.getpid(), "n": self.n, "rank": rank, "world_size": world, "mode": self.settings.mode,
                 "trainer": type(self.trainer).__name__, "module": type(self.trainer).__module__,
                 "callback": "added" if self.added is not None else "yours" if self.sanity else None,
                 "output_dir": str(args.output_dir)},
            )  # fmt: skip
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        with unbreakable("check the trainer's callbacks"):
            self.started = time.time()
            callbacks = self.trainer.callback_handler.callbacks
            others = [
                cb for cb in callbacks if type(cb).__name__ == "SanityCallback" and cb is not self.added
            ]
            if self.added is not None and others:  # the user added one after __init__: theirs watches
                # replaced in place by a callback that does nothing: Trainer is iterating the list
                callbacks[callbacks.index(self.added)] = TrainerCallback()
                self.added, self.sanity = None, others[0]
        return control

    def on_train_end(self, args, state, control, **kwargs):
        with unbreakable("send the report to hf-sanity"):
            self.export(finished=True)  # after SanityCallback's own on_train_end: it moved itself before us
        return control

    # -- run -----------------------------------------------------------------------------------------
    def _attach(self) -> None:
        self.sanity = watcher(self.trainer)
        if self.sanity is not None:
            return
        from hf_sanity.callback import SanityCallback
        from hf_sanity.integrations.llamafactory import cut_of_command
        from hf_sanity.measure.frameworks import LLAMA_FACTORY, of_trainer

        settings = self.settings
        self.added = self.sanity = SanityCallback(
            abort_on=settings.abort_on, select=settings.select, ignore=settings.ignore
        )
        if (
            of_trainer(self.trainer) is LLAMA_FACTORY
        ):  # its cutoff_len is in the config its command line names
            self.added.framework_cut = cut_of_command(sys.argv)
        callbacks = self.trainer.callback_handler.callbacks
        callbacks.insert(callbacks.index(self) + 1, self.added)  # after us: Trainer is iterating the list

    def export(self, *, finished: bool) -> None:
        """The main process's report of this trainer, to the parent (again at exit: the latest wins)."""
        with unbreakable("send the report to hf-sanity"):
            sanity = self.sanity
            if sanity is None or getattr(sanity, "trainer", None) is None or not sanity.sink.is_main:
                return  # never trained, or not the main process
            state = getattr(self.trainer, "state", None)
            record = self._record(sanity.report, finished=finished)
            record["state"] = dataclasses.asdict(state) if dataclasses.is_dataclass(state) else None
            send_report(self.settings.exchange, self.n, sanity.report, record)

    def _record(self, report, **extra) -> dict[str, Any]:
        rank, world = _rank(self.trainer)
        return {
            "pid": os.getpid(), "n": self.n, "rank": rank, "world_size": world, "mode": self.settings.mode,
            "trainer": type(self.trainer).__name__, "output_dir": str(self.trainer.args.output_dir),
            "started": self.started, "report": report.to_dict(), **extra,
        }  # fmt: skip

    # -- preflight -----------------------------------------------------------------------------------
    def preflight(self, *args, **kwargs):
        """``trainer.train()`` under ``hf-sanity preflight -- CMD``: preflight on this trainer instead, the
        report to the parent (rank 0), and this process ends: no training step, no checkpoint, nothing of the
        command after ``train()``."""
        self.started, code = time.time(), 0
        try:
            from hf_sanity.launch.preflight import check

            report = check(self.trainer, self.settings)
            if report is not None:
                send_report(self.settings.exchange, self.n, report, self._record(report))
        except KeyboardInterrupt:
            code = 130  # Ctrl-C: the command's usual status for it, nothing to report
        except BaseException as exc:
            message = str(exc) if type(exc).__name__ == "UserInputError" else f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                protocol.send(
                    protocol.record_path(self.settings.exchange, "failed", self.n),
                    {"pid": os.getpid(), "n": self.n, "trainer": type(self.trainer).__name__, "message": message,
                     "input": type(exc).__name__ == "UserInputError"},
                )  # fmt: skip
        finally:
            if self.folders is not None:
                with contextlib.suppress(Exception):
                    self.folders.restore()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)  # the parent reads the outcome from the records; nothing of the command runs on


def send_report(exchange: str, n: int, report, record: dict[str, Any]) -> None:
    """The report as JSON (any hf-sanity reads it) and as objects (its token views, for the same hf-sanity)."""
    portable = dataclasses.replace(
        report,
        findings=[dataclasses.replace(f, remedy=None) for f in report.findings],  # remedies hold code
        views=[view for view in report.views if _picklable(view)],
        fix_command=None,
    )
    with contextlib.suppress(Exception):
        protocol.send(protocol.record_path(exchange, "report", n, ".pickle"), pickle.dumps(portable))
    protocol.send(protocol.record_path(exchange, "report", n), record)


def _picklable(obj) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def _at_exit(pid: int) -> None:
    if os.getpid() != pid:  # a forked child (a dataloader worker) inherited the handler
        return
    for anchor in _anchors:
        anchor.export(finished=False)


class Folders:
    """The folders under a trainer's ``output_dir`` before it was built, so that the empty ones it created there
    (``Trainer.__init__`` creates ``output_dir``, GRPO its ``completions/``) can be removed: preflight writes
    nothing into the user's folders, and leaves none behind."""

    def __init__(self, output_dir) -> None:
        self.root = Path(output_dir).absolute()
        top = self.root
        while not top.parent.exists() and top.parent != top:
            top = top.parent
        self.top = top if not top.exists() else None  # the first folder of the path that did not exist
        self.before = (
            {self.root, *(p for p in self.root.rglob("*") if p.is_dir())} if self.root.is_dir() else set()
        )

    def restore(self) -> None:
        """Remove the folders created since, deepest first, where empty (a file in one keeps it)."""
        if not self.root.is_dir():
            return
        created = [p for p in self.root.rglob("*") if p.is_dir() and p not in self.before]
        if self.root not in self.before:
            created.append(self.root)
            parent = self.root.parent
            while self.top is not None and parent != self.top.parent and parent != parent.parent:
                created.append(parent)
                parent = parent.parent
        for folder in sorted(created, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
