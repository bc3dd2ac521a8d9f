"""SanityCallback at train end: the last checkpoint the Trainer saved, read for what a server needs beside the
weights (`hf_sanity.measure.saved`), judged by the `saved` detectors."""

from __future__ import annotations

from hf_sanity import catalog
from hf_sanity.measure.saved import last_checkpoint, read_saved
from hf_sanity.measure.vision import measure_modality


def check_last_checkpoint(callback, args, state) -> None:
    """The one call of ``SanityCallback.on_train_end`` for saved folders: only the main process reads it, and
    only a checkpoint this run wrote (none when it saved none: nothing to judge)."""
    if not callback.sink.is_main or not getattr(args, "output_dir", None):
        return
    folder = last_checkpoint(args.output_dir, state.global_step)
    if folder is None:
        return
    trainer = callback.trainer
    processing_class = getattr(trainer, "processing_class", None)
    modality = measure_modality(processing_class, getattr(trainer, "model", None) or callback.model)
    if not modality.is_vision:
        return
    subject = read_saved(folder, state.global_step, modality, processing_class)
    callback.sink.emit(catalog.run_all("saved", subject, callback.selection, step=state.global_step))
