"""hf-sanity's bootstrap: copied as ``sitecustomize.py`` into the folder ``hf-sanity run``/``preflight -- CMD``
puts first on ``PYTHONPATH``, so every Python process of the command runs it at start-up (Python imports the
first ``sitecustomize`` on its path; launchers pass the environment on to the processes they start).

It imports nothing and changes nothing else: it adds one finder to ``sys.meta_path`` that answers only for
``transformers.trainer``. When that module has loaded (completely, as it always does), the finder calls
:func:`hf_sanity.launch.hook.install` on it, and leaves ``sys.meta_path`` as it was. A process that never imports
transformers' Trainer never imports hf-sanity, torch or transformers because of this file. Nothing here may
break the command: whatever goes wrong is one line on stderr, and the command goes on unwatched.

Then the ``sitecustomize`` Python would have run without hf-sanity's folder first (the user's, a distribution's)
runs, as Python runs it.
"""

import os
import sys

ENV = "HF_SANITY_LAUNCH"  # hf_sanity.launch.protocol.ENV (this file imports nothing of hf-sanity's)
TARGET = "transformers.trainer"


def say(line: str) -> None:
    """One line on stderr, whatever state the process is in."""
    try:
        sys.stderr.write(f"hf-sanity: {line}\n")
        sys.stderr.flush()
    except Exception:
        pass


class AttachAfterTrainerLoads:
    """A meta-path finder for one module: it finds ``transformers.trainer`` as the finders after it would, and has
    the module's loader call :func:`attach` once the module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        spec = None
        for finder in list(sys.meta_path):
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if self in sys.meta_path:  # once per process: the finder leaves
            sys.meta_path.remove(self)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            say("transformers.trainer loads in a way hf-sanity cannot follow; the command runs unwatched")
            return spec
        run_module = loader.exec_module

        def exec_module(module):
            run_module(
                module
            )  # transformers.trainer itself, unchanged: hf-sanity attaches once it has loaded
            vars(loader).pop("exec_module", None)
            attach(module)

        loader.exec_module = exec_module  # this module's own loader object only
        return spec


def attach(trainer_module) -> None:
    try:
        from hf_sanity.launch import hook
    except Exception as exc:
        say(
            f"cannot watch this command's trainers: hf_sanity does not import in {sys.executable} "
            f"({type(exc).__name__}: {exc}); install hf-sanity in that environment. The command runs unwatched"
        )
        return
    try:
        hook.install(trainer_module)
    except Exception as exc:
        say(f"cannot watch this command's trainers ({type(exc).__name__}: {exc}); the command runs unwatched")


def run_next_sitecustomize() -> None:
    """The ``sitecustomize`` on ``sys.path`` after this file's folder, run as Python would have run it."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)  # its own errors are Python's usual "Error in sitecustomize" line


# One finder even when an `hf-sanity run` runs inside another (each copy of this file runs, the next chained).
if os.environ.get(ENV) and not any(type(f).__name__ == "AttachAfterTrainerLoads" for f in sys.meta_path):
    sys.meta_path.insert(0, AttachAfterTrainerLoads())
run_next_sitecustomize()
