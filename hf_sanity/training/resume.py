"""A run resumed from a checkpoint: what SanityCallback keeps in each checkpoint and takes back.

SanityCallback is a transformers ``ExportableState``: at every checkpoint Trainer saves its :func:`export` in
``trainer_state.json`` under ``stateful_callbacks["SanityCallback"]``: ``{"args": <the callback's settings>,
"attributes": {"saved_state": ...}}``, the state being small plain data: the step, every monitor's windows,
baselines and what fired (:meth:`hf_sanity.rules.training.base.Monitor.state`) and the findings so far, every
step up to the checkpoint read first (every rank reads at the end of a step that saves; on one process
``state()`` also reads, for the saves at an epoch's end).

On ``trainer.train(resume_from_checkpoint=...)`` the TrainerState loaded from the checkpoint holds it, and
:func:`begin` (train begin, global step > 0) takes it back into the callback the user passed: the monitors
continue their windows, the findings of the steps before the checkpoint stay in the report (not printed or
acted on again), the first batch is not judged as step 0 (its model is trained). Trainer itself rebuilds a
callback from that state only with ``restore_callback_states_from_checkpoint=True``, and then it drops the
instance the user passed for a new one of the same class name: :func:`handed_back` puts the user's instance
back in its place, so that ``sanity.report`` is this run's.

A checkpoint without a usable state (written without hf-sanity, by another state format, at another step)
resumes with fresh monitors that know they did not see the run's start: what they judge against it (the
step-0 loss against chance, a loss flat at its starting level, predictions frozen since the first probe) they
do not judge. Either way the report's stats say ``resumed_from_step`` and ``resumed_state``.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Mapping
from typing import Any

from hf_sanity.findings import Finding
from hf_sanity.training.instrument import find_trainer

FORMAT = 1  # the layout of ``saved_state``; another one is not read
ATTRIBUTE = (
    "saved_state"  # Trainer sets it on the callback it rebuilds (restore_callback_states_from_checkpoint)
)
FINDING_FIELDS = ("rule", "severity", "message", "evidence", "fix", "step")

# The callback each Trainer holds, remembered when Trainer asks it for its state (before it may replace it).
_GIVEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def settings(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """SanityCallback's constructor arguments as JSON data (the ``args`` Trainer rebuilds it with); one that is
    not plain data (prompt rows given as a Dataset) stays behind: the default takes its place."""
    out = {}
    for key, value in arguments.items():
        value = sorted(value) if isinstance(value, (set, frozenset, tuple)) else value  # rules to select
        with contextlib.suppress(TypeError, ValueError):
            if key != "self":
                json.dumps(value)
                out[key] = value
    return out


def export(callback) -> dict[str, Any]:
    """``SanityCallback.state()``: what Trainer saves in a checkpoint (never raises: a checkpoint must not fail
    for hf-sanity; a state that cannot be made is an internal-error finding and saved as None)."""
    trainer = saved = None
    with callback.sink.guard("checkpoint-state"):
        trainer = find_trainer()
        if trainer is not None and callback in getattr(
            getattr(trainer, "callback_handler", None), "callbacks", ()
        ):
            _GIVEN[trainer] = weakref.ref(callback)
    with callback.sink.guard("checkpoint-state"):
        saved = snapshot(callback, trainer)
    return {"args": dict(callback.settings), "attributes": {ATTRIBUTE: saved}}


def snapshot(callback, trainer) -> dict[str, Any] | None:
    """The run's state now (None before a run has begun: nothing measured)."""
    from hf_sanity.report import version

    if callback.sampler is None:
        return None
    step = getattr(getattr(trainer or callback.trainer, "state", None), "global_step", None)
    return {
        "format": FORMAT,
        "hf_sanity_version": version(),
        "step": step,
        "monitors": callback.monitors.state(),
        "findings": [{k: getattr(f, k) for k in FINDING_FIELDS} for f in callback.sink.report.findings],
    }


def handed_back(callback):
    """The instance the user gave this Trainer, put back in the place of ``callback`` when Trainer replaced it
    by ``callback``, a copy rebuilt from the checkpoint (None when ``callback`` is the one it was given)."""
    trainer = find_trainer()
    given = _GIVEN.get(trainer) if trainer is not None else None
    original = given() if given is not None else None
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None)
    if original is None or original is callback or callbacks is None:
        return None
    if callback not in callbacks or original in callbacks:
        return None
    callbacks[callbacks.index(callback)] = original  # Trainer is iterating this list: replaced in place
    return original


def begin(callback, state) -> dict[str, Any]:
    """At train begin: on a resumed run (global step > 0), continue from the checkpoint's state, or start
    afresh knowing the run's start was not seen; returns the report's stats for it (empty on a fresh run)."""
    step = int(getattr(state, "global_step", 0) or 0)
    stored = getattr(state, "stateful_callbacks", None)
    stored = stored if isinstance(stored, dict) else {}
    name = type(callback).__name__
    if step <= 0:
        return {}
    saved, why = usable(stored.get(name), step)
    callback.first.judge_step0 = False
    callback.monitors.restore(saved["monitors"] if saved else None, first_step=step + 1)
    with callback.sink.guard("resume", step):
        if saved:
            callback.sink.restore([Finding(**{k: f[k] for k in FINDING_FIELDS}) for f in saved["findings"]])
    # Trainer's _save_checkpoint looks each ExportableState up by class name in the loaded state: a checkpoint
    # written without this callback has no entry, and the next save would raise KeyError.
    stored.setdefault(name, export(callback))
    return {"resumed_from_step": step, "resumed_state": "restored" if saved else f"not restored: {why}"}


def usable(entry: Any, step: int) -> tuple[dict[str, Any] | None, str | None]:
    """(the saved state in a checkpoint's ``stateful_callbacks`` entry, None) when it can be continued from,
    else (None, why not)."""
    if isinstance(entry, list):  # Trainer keeps a list when several callbacks share the class name
        entry = next((e for e in entry if isinstance(e, Mapping)), None)
    if not isinstance(entry, Mapping):
        return None, "the checkpoint holds no hf-sanity state (written without SanityCallback)"
    saved = (entry.get("attributes") or {}).get(ATTRIBUTE)
    if not isinstance(saved, Mapping):
        return None, "the checkpoint holds no hf-sanity state"
    if saved.get("format") != FORMAT:
        return None, f"state format {saved.get('format')!r} (hf-sanity {saved.get('hf_sanity_version')})"
    if saved.get("step") != step:
        return None, f"the state was saved at step {saved.get('step')}, the checkpoint is at step {step}"
    return dict(saved), None
