"""`SanityCallback`: watch a real Trainer run and report its failures as findings, at the step they appear.

    sanity = SanityCallback()                       # abort_on="error" to stop at the first error
    Trainer(..., callbacks=[sanity]).train()        # or TRL's SFTTrainer
    sanity.report.print()                           # also in output_dir/hf-sanity/report.json

The callback is an adapter: it forwards Trainer events to the plain monitors of `hf_sanity.monitors`
(``monitor.update(step, values) -> findings``), which hold every threshold and every verdict. What it adds
is the plumbing to observe a run without changing it:

* at train begin it finds the Trainer, wraps ``trainer.training_step`` (the loss of every micro-batch as
  Trainer sees it, before ``logging_nan_inf_filter`` hides NaN) and ``trainer._get_grad_norm`` (the
  pre-clip gradient norm Trainer computes anyway), and hooks the model's forward (the first real batch, and
  whether each training forward runs in train mode). All of it is removed at train end.
* per-step values stay on the device (:class:`~hf_sanity.monitors.recorder.Recorder`) and are read in one
  transfer every ``check_every`` steps and at logging steps. A non-finite loss is known before the
  optimizer step where that costs no synchronisation (always on the CPU; on CUDA once Trainer's own
  per-step NaN filter has synchronised), so the offending batch is replayed with the weights that produced it.
* extra forwards (the step-0 probe, the predictions probe, the NaN replay) run without grad, in eval mode,
  with the RNG states and every module's train/eval mode restored: with ``abort_on="never"`` a run with the
  callback is bit-for-bit the run without it.
* every check runs in a guard: an exception becomes an ``internal-error`` finding and training goes on.
* under DDP every rank computes its findings; every ``sync_every`` steps all ranks exchange them (and a
  checksum per parameter, for ``ranks-diverged``) in one all_reduce, plus one all_gather_object when some
  rank has something new. Only the main process prints and writes the report.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_sanity.findings import Finding
from hf_sanity.monitors import (
    EarlyFlags,
    GradientMonitor,
    LossMonitor,
    MemoryMonitor,
    PredictionsMonitor,
    RankMonitor,
    Recorder,
    TrainModeMonitor,
    UpdateMonitor,
    first_batch,
    gradients,
    memory,
    nonfinite,
    probe,
    ranks,
    updates,
)
from hf_sanity.monitors.base import median
from hf_sanity.monitors.mode import train_only_modules
from hf_sanity.report import Report
from hf_sanity.rules.internal import internal_error
from hf_sanity.selection import resolve

ABORT_CHOICES = ("error", "never")
SAMPLED_PARAMS = 4  # tensors sampled for the update ratio and the stale-gradient check
SAMPLE_MAX_ELEMENTS = 1 << 24  # ... each at most 16M elements (cloned at measured steps)
EARLY_MEASURE_STEPS = 10  # the update ratio is measured at every one of the first steps, then every check


class SanityCallback(TrainerCallback):
    """Watches a Trainer run; findings in :attr:`report` and in ``output_dir/hf-sanity/report.json``.

    ``abort_on="error"`` stops training cleanly (``control.should_training_stop``) at the first error finding,
    after writing the report; ``"never"`` (the default) only reports. ``select``/``ignore`` pick rules as in
    preflight. ``check_every``: steps between reads of the on-device values (also read at every logging step);
    ``probe_every``: steps between predictions probes; ``sync_every``: steps between the cross-rank exchanges
    under DDP (defaults to ``check_every``).
    """

    def __init__(
        self,
        abort_on: str = "never",
        select: str | Iterable[str] | None = None,
        ignore: str | Iterable[str] | None = None,
        *,
        check_every: int = 10,
        probe_every: int = 50,
        sync_every: int | None = None,
        use_config: bool = True,
        print_findings: bool = True,
    ) -> None:
        if abort_on not in ABORT_CHOICES:
            raise ValueError(f"abort_on must be one of {ABORT_CHOICES}, got {abort_on!r}")
        for name, value in (
            ("check_every", check_every),
            ("probe_every", probe_every),
            ("sync_every", sync_every),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.abort_on = abort_on
        self.selection = resolve(select, ignore, use_config=use_config)
        self.check_every = check_every
        self.probe_every = probe_every
        self.sync_every = sync_every or check_every
        self.print_findings = print_findings
        self._reset()

    # -- state ---------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.report = Report(title="hf-sanity training")
        self.trainer = None
        self.model = None
        self.recorder = Recorder()
        self.early = EarlyFlags()
        self.loss_monitor = LossMonitor()
        self.gradient_monitor = GradientMonitor()
        self.update_monitor = UpdateMonitor()
        self.mode_monitor = TrainModeMonitor()
        self.memory_monitor = MemoryMonitor()
        self.predictions_monitor = PredictionsMonitor()
        self.rank_monitor = RankMonitor()
        self.counts: dict[str, int] = {}
        self.is_main = True
        self.rank, self.world_size = 0, 1
        self.output_dir: Path | None = None
        self._installed: list[tuple[Any, str, Any, bool]] = []  # (object, attribute, previous, had it)
        self._hooks: list[Any] = []
        self._in_train = False
        self._busy = False
        self._step = 0  # the optimizer step being computed (1-based, as Trainer logs it)
        self._micro = 0
        self._batches: dict[int, list[dict[str, Any]]] = {}
        self._first_batch_done = False
        self._first_labels = None
        self._probe_batch = None
        self._probe_prev = None
        self._label_counts = None
        self._half = False
        self._autocast = None
        self._scaler = False
        self._replicated = False
        self._sharded = False
        self._trainable: list[tuple[str, Any]] = []
        self._stale_sample: list[Any] = []
        self._update_sample: list[Any] = []
        self._snapshot = None
        self._optimizer_ids: set[int] | None = None
        self._step_losses: list[tuple[int, float]] = []
        self._step_lr: dict[int, float] = {}
        self._unsent: list[Finding] = []
        self._errors_unsent = False
        self._stop_pending = False
        self._evaluations: list[int] = []
        self._failed_checks: set[str] = set()
        self._seconds = 0.0
        self._timings: dict[str, float] = {}
        self._reads = 0
        self._warmup = 0

    # -- guards --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _guard(self, check: str):
        """Run one check: its exception becomes an internal-error finding (once per check), never the run's."""
        started = time.perf_counter()
        try:
            yield
        except Exception as exc:
            if check not in self._failed_checks:
                self._failed_checks.add(check)
                self._emit([internal_error(check, exc, self._step or None)])
        finally:
            elapsed = time.perf_counter() - started
            self._seconds += elapsed
            self._timings[check] = self._timings.get(check, 0.0) + elapsed

    def _want(self, *slugs: str) -> bool:
        return any(self.selection.enabled(slug) for slug in slugs)

    # -- Trainer events ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._uninstall()
        self._reset()
        with self._guard("callback-setup"):  # first and alone: every rank must agree on the world size
            self.is_main = bool(state.is_world_process_zero)
            self.trainer = find_trainer()
            self._setup_distributed()
        with self._guard("callback-setup"):
            self.model = getattr(self.trainer, "model", None) or model
            self.output_dir = Path(args.output_dir or ".") / "hf-sanity"
            self._setup_run(args, state, optimizer or getattr(self.trainer, "optimizer", None))
            self._install()
            self._move_before_reporters()
        if self._want("memory-growth", "oom"):
            with self._guard("memory-growth"):
                self._memory_check(0)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = state.global_step + 1
        self._micro = 0
        if self._stale_sample and self._want("stale-gradients"):
            with self._guard("stale-gradients"):
                self.recorder.push(self._step, "stale_norm", gradients.present_norm(self._stale_sample))
        return control

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        step = state.global_step + 1
        if self._want("lr-zero", "lr-too-low", "loss-flat"):
            with self._guard("callback-gradient-path"):
                self._gradient_path(step, optimizer or getattr(self.trainer, "optimizer", None))
        with self._guard("callback-early-read"):
            if self.early.nonfinite() is not None:
                self._read(now=step, weights_step=step, control=control)
        self._snapshot = None
        if self._update_sample and (step <= EARLY_MEASURE_STEPS or step % self.check_every == 0):
            with self._guard("callback-update-ratio"):
                self._snapshot = updates.snapshot(self._update_sample)
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1
        if self._snapshot is not None:
            with self._guard("callback-update-ratio"):
                skipped = bool(
                    getattr(getattr(self.trainer, "accelerator", None), "optimizer_step_was_skipped", False)
                )
                if not skipped:
                    self._record_update(step)
            self._snapshot = None
        return control

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if self.probe_every and step % self.probe_every == 0 and self._want("predictions-frozen"):
            with self._guard("predictions-frozen"):
                self._probe(step)
        if step % self.check_every == 0 or control.should_log:
            self._read(now=step, control=control)
        if self.world_size > 1 and step % self.sync_every == 0:
            with self._guard("callback-sync"):
                self._sync(step, control)
        if self._stop_pending and self.world_size == 1:
            self._stop(control)
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._evaluations.append(state.global_step)  # after it, training forwards must be back in train mode
        self._read(now=state.global_step, control=control)
        self._curves(state, final=False)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            for slug, count in self.counts.items():
                logs[f"hf_sanity/{slug}"] = count
        return control

    def on_train_end(self, args, state, control, **kwargs):
        try:
            self._read(now=state.global_step, control=control)
            self._curves(state, final=True)
            if self.world_size > 1:
                with self._guard("callback-sync"):
                    self._sync(state.global_step, control, final=True)
            with self._guard("report"):
                self.report.stats.update(self._stats(state))
                self._write()
        finally:
            self._uninstall()
        return control

    # -- setup ---------------------------------------------------------------------------------------
    def _setup_distributed(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        trainer = self.trainer
        self._sharded = bool(
            getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False)
        )
        self._replicated = self.world_size > 1 and not self._sharded
        self.rank_monitor = RankMonitor(self.world_size)

    def _setup_run(self, args, state, optimizer) -> None:
        import torch

        model = self.model
        if model is None:
            return
        params = list(model.named_parameters())
        self._trainable = [(n, p) for n, p in params if p.requires_grad]
        accelerator = getattr(self.trainer, "accelerator", None)
        precision = getattr(accelerator, "mixed_precision", "no") if accelerator is not None else "no"
        native = bool(getattr(accelerator, "native_amp", False))
        self._half = (native and precision in ("fp16", "bf16")) or any(
            p.dtype in (torch.float16, torch.bfloat16) for _, p in params[:8]
        )
        self._scaler = getattr(accelerator, "scaler", None) is not None
        with contextlib.suppress(Exception):
            self._warmup = int(args.get_warmup_steps(state.max_steps or 0))
        self.update_monitor = UpdateMonitor(warmup_steps=self._warmup)
        self._stale_sample = updates.spread([p for _, p in self._trainable], SAMPLED_PARAMS)
        # Sharded optimizers (FSDP, DeepSpeed) hold flattened copies: membership cannot be checked by identity.
        self._optimizer_ids = None if self._sharded else updates.optimizer_ids(optimizer)
        in_opt = [
            p for _, p in self._trainable if self._optimizer_ids is None or id(p) in self._optimizer_ids
        ]
        small = [p for p in in_opt if p.numel() <= SAMPLE_MAX_ELEMENTS] or sorted(
            in_opt, key=lambda p: p.numel()
        )[:1]
        self._update_sample = (
            updates.spread(small, SAMPLED_PARAMS) if self._want("loss-flat", "lr-too-low") else []
        )
        if self._want("no-trainable-params", "optimizer-missing-params"):
            with self._guard("optimizer-missing-params"):
                names = [n for n, _ in self._trainable]
                inside = (
                    None
                    if self._optimizer_ids is None
                    else [n for n, p in self._trainable if id(p) in self._optimizer_ids]
                )
                total = sum(p.numel() for _, p in params)
                self._emit(updates.setup_findings(total_params=total, trainable=names, in_optimizer=inside))
        if self._want("loss-plateau-prior"):
            embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            rows = getattr(embeddings, "num_embeddings", None)
            if rows:
                device = next(iter(p.device for _, p in params), torch.device("cpu"))
                self._label_counts = torch.zeros(rows, dtype=torch.float32, device=device)

    def _install(self) -> None:
        trainer, model = self.trainer, self.model
        if trainer is not None:
            self._wrap(trainer, "training_step", self._wrapped_training_step)
            if hasattr(trainer, "_get_grad_norm"):
                self._wrap(trainer, "_get_grad_norm", self._wrapped_grad_norm)
        if model is not None:
            self._hooks.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._hooks.append(model.register_forward_hook(self._post_forward, with_kwargs=True))

    def _wrap(self, obj, name: str, make) -> None:
        had = name in vars(obj)
        previous = vars(obj).get(name)
        original = getattr(obj, name)
        setattr(obj, name, make(original))
        self._installed.append((obj, name, previous, had))

    def _uninstall(self) -> None:
        for obj, name, previous, had in reversed(getattr(self, "_installed", [])):
            if had:
                setattr(obj, name, previous)
            else:
                vars(obj).pop(name, None)
        for handle in getattr(self, "_hooks", []):
            handle.remove()
        self._installed, self._hooks = [], []

    def _move_before_reporters(self) -> None:
        """Sit right after DefaultFlowCallback, so every reporting callback's on_log sees our counters."""
        handler = getattr(self.trainer, "callback_handler", None)
        callbacks = getattr(handler, "callbacks", None)
        if not callbacks or self not in callbacks:
            return
        here = callbacks.index(self)
        target = 1 if type(callbacks[0]).__name__ == "DefaultFlowCallback" else 0
        if here > target:  # moving earlier is safe while Trainer iterates this list
            callbacks.insert(target, callbacks.pop(here))

    # -- wrappers and hooks --------------------------------------------------------------------------
    def _wrapped_training_step(self, original):
        def training_step(model, inputs, *args, **kwargs):
            step = self._step or 1
            with self._guard("callback-batch"):
                self._before_micro(step, inputs)
            self._in_train = True
            try:
                loss = original(model, inputs, *args, **kwargs)
            except BaseException as exc:
                self._in_train = False
                with self._guard("callback-exception"):
                    self._on_exception(exc)
                raise
            self._in_train = False
            with self._guard("callback-loss"):
                self._after_micro(step, loss)
            return loss

        return training_step

    def _wrapped_grad_norm(self, original):
        def _get_grad_norm(*args, **kwargs):
            norm = original(*args, **kwargs)
            with self._guard("callback-grad-norm"):
                if norm is not None:
                    self.recorder.push(self._step or 1, "grad_norm", norm)
            return norm

        return _get_grad_norm

    def _before_micro(self, step: int, inputs) -> None:
        batch = dict(inputs) if hasattr(inputs, "items") else {}
        self._batches.setdefault(step, []).append(batch)
        if self._label_counts is not None and "labels" in batch:
            labels = batch["labels"]
            if hasattr(labels, "dim") and labels.dim() >= 2 and not labels.is_floating_point():
                shifted = labels[..., 1:].reshape(-1).to(self._label_counts.device, non_blocking=True)
                ids = shifted.clamp(0, self._label_counts.numel() - 1)
                self._label_counts.index_add_(0, ids, (shifted != nonfinite.IGNORE_INDEX).float())
        if not self._first_batch_done and "labels" in batch:
            self._first_labels = batch["labels"]

    def _on_exception(self, exc: BaseException) -> None:
        """Training dies: report an out-of-memory error with its memory picture, write the report, clean up."""
        try:
            if memory.is_oom(exc) and self._want("oom"):
                with self._guard(
                    "oom"
                ):  # memory is short: every part on its own, the report written regardless
                    self._read(now=self._step)
                text = str(exc).strip()
                oom: dict[str, Any] = {"error": text.splitlines()[0][:300] if text else type(exc).__name__}
                with self._guard("oom"):
                    oom.update(memory.memory_breakdown(self.model, getattr(self.trainer, "optimizer", None)))
                self._feed(self.memory_monitor, self._step or 1, {"oom": oom}, "oom")
            state = getattr(self.trainer, "state", None)
            if state is not None:
                self.report.stats.update(self._stats(state))
            self.report.stats["aborted_by"] = type(exc).__name__
        finally:
            try:
                with self._guard("report"):
                    self._write()
            finally:
                self._uninstall()

    def _after_micro(self, step: int, loss) -> None:
        import torch

        if isinstance(loss, torch.Tensor):
            self.recorder.push(step, "loss", loss)
            self.early.mark(step, self._micro, loss)
        self._micro += 1

    def _pre_forward(self, module, args, kwargs):
        if not self._in_train or self._busy:
            return None
        step = self._step or 1
        if self._want("train-mode-off"):
            with self._guard("train-mode-off"):
                self.recorder.push(step, "training", bool(module.training))
        if self._autocast is None:
            with self._guard("callback-precision"):
                self._autocast = nonfinite.autocast_state(module) or False
                self._half = self._half or bool(self._autocast)
        if not self._first_batch_done:
            self._first_batch_done = True
            self._busy = True
            try:
                with self._guard("first-batch"):
                    self._first_batch(module, args, kwargs)
            finally:
                self._busy = False
        return None

    def _post_forward(self, module, args, kwargs, output):
        if self._in_train and not self._busy and getattr(self, "_first_shapes", None) is not None:
            shapes, self._first_shapes = self._first_shapes, None
            with self._guard("shape-mismatch"):
                logits = getattr(output, "logits", None)
                if self._want("shape-mismatch"):
                    self._emit(
                        first_batch.shape_findings(
                            shapes, tuple(logits.shape) if logits is not None else None
                        )
                    )
        return None

    def _first_batch(self, module, args, kwargs) -> None:
        import torch

        batch = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        if "input_ids" not in batch and args and isinstance(args[0], torch.Tensor):
            batch["input_ids"] = args[0]
        if "labels" not in batch and self._first_labels is not None:
            batch["labels"] = self._first_labels  # popped by compute_loss for a custom loss / label smoothing
        self._first_labels = None
        self._first_shapes = {k: tuple(v.shape) for k, v in batch.items() if k in first_batch.ALIGNED}
        if self._want("shape-mismatch"):  # before the forward: a mismatch may well crash it
            with self._guard("shape-mismatch"):
                self._emit(first_batch.shape_findings(self._first_shapes))
        step0 = None
        if self._want("init-loss-off-chance", "predictions-frozen"):
            with self._guard("callback-probe"):
                self._probe_batch = probe.probe_batch(batch)
                measured = probe.probe(module, self._probe_batch, stats=True)
                self._probe_prev = measured.get("argmax")
                step0 = measured.get("stats")
        tokenizer = getattr(self.trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
        if self._want(*_stage_rules("tokens")) or step0 is not None:
            from hf_sanity.preflight.trainer_batches import trainer_max_len

            max_len = trainer_max_len(self.trainer) if self.trainer is not None else None
            self._emit(
                first_batch.token_findings(
                    tokenizer, batch, model=module, trainer=self.trainer, selection=self.selection,
                    max_len=max_len, step0=step0,
                )
            )  # fmt: skip

    # -- per-step measurements -----------------------------------------------------------------------
    def _gradient_path(self, step: int, optimizer) -> None:
        lr = updates.max_lr(optimizer)
        if lr is not None:
            self.recorder.push(step, "lr", lr)
            self._step_lr[step] = lr
        if self._want("loss-flat"):
            trainable = [p for _, p in self._trainable]
            for key, value in updates.gradient_path(trainable, self._optimizer_ids).items():
                self.recorder.push(step, key, value)

    def _record_update(self, step: int) -> None:
        ratio, updated = updates.measure_update(self._update_sample, self._snapshot)
        self.recorder.push(step, "update_ratio", ratio)
        self.recorder.push(step, "updated", updated)

    def _probe(self, step: int) -> None:
        if self._probe_batch is None or self.model is None:
            return
        measured = probe.probe(self.model, self._probe_batch)
        current = measured.get("argmax")
        if current is None:
            return
        if self._probe_prev is not None and self._probe_prev.shape == current.shape:
            self.recorder.push(step, "probe_changed", (current != self._probe_prev).float().mean())
        self._probe_prev = current

    def _memory_check(self, step: int) -> None:
        holders = memory.graph_tensors(memory.roots(self.trainer, self.model, skip=self))
        values: dict[str, Any] = {"graph_tensors": sum(holders.values()), "holders": holders}
        allocated = memory.allocated(self.model)
        if allocated is not None:
            values["allocated"] = allocated
        self._feed(self.memory_monitor, step, values, "memory-growth")

    # -- reading ------------------------------------------------------------------------------------
    def _read(self, *, now: int, weights_step: int | None = None, control=None) -> None:
        """Move every recorded value to the host in one transfer and feed the monitors, step by step."""
        records: dict[int, dict[str, list[Any]]] = {}
        with self._guard("callback-read"):
            if self._label_counts is not None and len(self.recorder):
                counts = self._label_counts
                total = counts.sum()
                p = counts / total.clamp_min(1)
                self.recorder.push(now, "label_entropy", -(p * p.clamp_min(1e-30).log()).sum())
            records = self.recorder.read()
            self._reads += 1
        for step, raw in records.items():
            with self._guard("callback-read"):
                self._feed_step(step, raw, weights_step)
        if records and self._want("memory-growth", "oom"):
            with self._guard("memory-growth"):
                self._memory_check(now)
        # Batches are kept only until their step has been read (the current step's until it is complete).
        for step in [s for s in self._batches if s < now or (s == now and weights_step is None)]:
            del self._batches[step]
        if self._stop_pending and control is not None and self.world_size == 1:
            self._stop(control)

    def _feed_step(self, step: int, raw: dict[str, list[Any]], weights_step: int | None) -> None:
        values = self._values(step, raw, weights_step)
        for monitor, check in (
            (self.loss_monitor, "nonfinite-loss"),
            (self.gradient_monitor, "grad-explosion"),
            (self.update_monitor, "loss-flat"),
            (self.mode_monitor, "train-mode-off"),
        ):
            self._feed(monitor, step, values, check)
        if "probe_changed" in raw:
            level = [v for _, v in self._step_losses[-5:]]
            start = [v for _, v in self._step_losses[:5]]
            probed = {
                "changed": raw["probe_changed"][-1],
                "loss_level": median(level) if level else None,
                "loss_start": median(start) if start else None,
            }
            self._feed(self.predictions_monitor, step, probed, "predictions-frozen")

    def _values(self, step: int, raw: dict[str, list[Any]], weights_step: int | None) -> dict[str, Any]:
        values: dict[str, Any] = {}
        if "loss" in raw:
            micro = raw["loss"]
            values["losses"] = micro
            values["loss"] = float(sum(micro))
            if all(math.isfinite(x) for x in micro):
                self._step_losses.append((step, values["loss"]))
            else:
                values["nonfinite"] = self._diagnose(step, micro, weights_step)
        for key in (
            "grad_norm",
            "stale_norm",
            "label_entropy",
            "update_ratio",
            "lr",
            "n_trainable",
            "n_with_grad",
            "n_in_optimizer",
        ):
            if key in raw:
                values[key] = raw[key][-1]
        if "updated" in raw:
            values["updated"] = raw["updated"][-1] > 0.5
        if "training" in raw:
            values["training"] = all(raw["training"])
            if not values["training"]:
                values["train_only_modules"] = (
                    train_only_modules(self.model) if self.model is not None else None
                )
                values["after_eval"] = max((s for s in self._evaluations if s < step), default=None)
        if "loss" in raw:
            values["loss_finite"] = all(math.isfinite(x) for x in raw["loss"])
        values["scaler"] = self._scaler
        return values

    def _feed(self, monitor, step: int, values: dict[str, Any], check: str) -> None:
        if monitor.done or not self._want(*(rule.slug for rule in monitor.rules)):
            return
        with self._guard(check):
            self._emit(monitor.update(step, values))

    def _diagnose(self, step: int, micro: list[float], weights_step: int | None) -> dict[str, Any]:
        """The facts of the first non-finite loss: the batch itself, a replay of it, the batch saved."""
        if "nonfinite-loss" in self.loss_monitor.fired or not self._want("nonfinite-loss"):
            return {}
        facts: dict[str, Any] = {"half_precision": self._half}
        with self._guard("nonfinite-loss"):
            index = next((i for i, x in enumerate(micro) if not math.isfinite(x)), 0)
            batches = self._batches.get(step, [])
            if index >= len(batches):
                facts["replay_skipped"] = "the batch is no longer held"
                return facts
            batch = batches[index]
            facts["batch_file"] = self._save_batch(batch, f"nonfinite-loss-step{step}")
            skip = None
            if self._sharded or self.model is None:
                skip = "sharded model (FSDP/DeepSpeed): a one-rank forward would deadlock"
            elif weights_step != step and not nonfinite.weights_finite(self.model):
                skip = f"the weights are non-finite by step {self._step} (read later than step {step})"
            facts.update(
                nonfinite.diagnose(
                    batch, None if skip else self.model, half_precision=self._half,
                    autocast=self._autocast or None, skip=skip,
                )
            )  # fmt: skip
            if not skip:
                facts["replay_weights"] = "same step" if weights_step == step else f"step {self._step}"
        return facts

    def _save_batch(self, batch, name: str) -> str | None:
        if self.output_dir is None:
            return None
        suffix = f"-rank{self.rank}" if self.world_size > 1 else ""
        path = nonfinite.save_batch(batch, self.output_dir / f"{name}{suffix}.safetensors")
        return str(path) if path else None

    # -- findings -----------------------------------------------------------------------------------
    def _emit(self, findings: Iterable[Finding]) -> None:
        for finding in findings:
            kept = self.selection.apply(finding)
            if kept is None or self._duplicate(kept):
                continue
            if self.world_size > 1:
                kept.evidence["rank"] = self.rank
            if kept.rule == "grad-explosion" and kept.step in self._batches:
                with contextlib.suppress(Exception):
                    kept.evidence["batch_file"] = self._save_batch(
                        self._batches[kept.step][0], f"grad-explosion-step{kept.step}"
                    )
            self._add(kept)
            if self.world_size > 1:
                self._unsent.append(kept)
                self._errors_unsent |= kept.severity == "error"
            if kept.severity == "error" and self.abort_on == "error":
                self._stop_pending = True

    def _duplicate(self, finding: Finding) -> bool:
        if finding.rule == "internal-error":
            return any(
                f.rule == finding.rule and f.evidence.get("check") == finding.evidence.get("check")
                for f in self.report.findings
            )
        return finding.rule in self.counts

    def _add(self, finding: Finding) -> None:
        self.report.add(finding)
        self.counts[finding.rule] = self.counts.get(finding.rule, 0) + 1
        self._print(finding)

    def _merge(self, incoming: list[dict[str, Any]]) -> None:
        """Findings of other ranks, on the main process: one per rule, the earliest step wins."""
        for data in incoming:
            finding = Finding(**data)
            kept = self.selection.apply(finding)
            if kept is None:
                continue
            mine = [f for f in self.report.findings if f.rule == kept.rule]
            if mine and kept.rule != "internal-error":
                if kept.step is not None and mine[0].step is not None and kept.step < mine[0].step:
                    self.report.findings.remove(mine[0])
                    self.report.add(kept)
                    self._print(kept)
                continue
            self._add(kept)

    def _print(self, finding: Finding) -> None:
        """Print a finding once, when it first fires (main process)."""
        if self.is_main and self.print_findings:
            with contextlib.suppress(Exception):
                from rich.console import Console

                from hf_sanity.report import render_finding

                Console(stderr=True).print(render_finding(finding))

    def _stop(self, control) -> None:
        self._stop_pending = False
        with self._guard("report"):
            self._write()
        control.should_training_stop = True
        trainer_control = getattr(self.trainer, "control", None)
        if trainer_control is not None:
            trainer_control.should_training_stop = True

    def _write(self) -> None:
        if self.is_main and self.output_dir is not None:
            self.report.write_json(self.output_dir / "report.json")

    def _stats(self, state) -> dict[str, Any]:
        return {
            "steps": state.global_step,
            "reads": self._reads,
            "transfers": self.recorder.transfers,
            "callback_seconds": round(self._seconds, 3),
            "callback_seconds_by_check": {
                k: round(v, 3) for k, v in sorted(self._timings.items(), key=lambda kv: -kv[1])[:5]
            },
            "world_size": self.world_size,
        }

    # -- curves -------------------------------------------------------------------------------------
    def _curves(self, state, *, final: bool) -> None:
        if not self.is_main:
            return
        with self._guard("curves"):
            try:
                from hf_sanity.rules.curves import Curves, analyze
            except ImportError:  # the curve rules are not there yet
                return
            from hf_sanity import catalog

            vocab = None
            if self.model is not None and hasattr(self.model, "get_input_embeddings"):
                vocab = getattr(self.model.get_input_embeddings(), "num_embeddings", None)
            curves = Curves.from_log_history(state.log_history, vocab_size=vocab)
            if self._step_losses:  # the exact per-step losses rather than the logged averages
                curves.train_steps = [s for s, _ in self._step_losses]
                curves.train_loss = [v for _, v in self._step_losses]
                curves.lr = (
                    [self._step_lr.get(s, math.nan) for s in curves.train_steps] if self._step_lr else []
                )
            rules = catalog.load()
            found = [
                f for f in analyze(curves, final=final)
                if f.rule == "internal-error" or getattr(rules.get(f.rule), "stage", "") == "curves"
            ]  # fmt: skip
            for finding in found:
                if finding.step is None:
                    finding.step = state.global_step
            self._emit(found)

    # -- distributed --------------------------------------------------------------------------------
    def _sync(self, step: int, control, final: bool = False) -> None:
        """All ranks, same steps, same order: one all_reduce (checksums, new findings, errors), and one
        all_gather_object when some rank has new findings."""
        import torch
        import torch.distributed as dist

        device = ranks.collective_device()
        vector = torch.zeros(0, dtype=torch.float64, device=device)
        names: list[str] = []
        if self._replicated and self._want("ranks-diverged") and self.model is not None:
            named = list(self.model.named_parameters())
            names = [n for n, _ in named]
            # Same length on every rank whatever happens: a collective of mismatched sizes would hang.
            vector = torch.full((len(named),), math.nan, dtype=torch.float64, device=device)
            with self._guard("ranks-diverged"):
                vector = ranks.checksums([p for _, p in named]).to(device)
        flags = torch.tensor(
            [len(self._unsent), float(self._errors_unsent or self._stop_pending)], device=device
        )
        high, low, flags = ranks.all_max_min(vector, flags)
        diverged_now = False
        if vector.numel():  # every rank sees the same reduced checksums, so every rank decides alike
            before = len(self._unsent)
            self._feed(
                self.rank_monitor,
                step,
                {"checksum_max": high.tolist(), "checksum_min": low.tolist(), "names": names},
                "ranks-diverged",
            )
            diverged_now = len(self._unsent) > before
        if int(flags[0].item()) > 0 or diverged_now:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, [_finding_data(f) for f in self._unsent])
            if self.is_main:
                with self._guard("callback-sync"):
                    for rank, items in enumerate(gathered):
                        if rank != self.rank and items:
                            self._merge(items)
        self._unsent, self._errors_unsent = [], False
        if self.abort_on == "error" and bool(flags[1].item()) and not final:
            self._stop(control)


def _finding_data(finding: Finding) -> dict[str, Any]:
    return {
        "rule": finding.rule,
        "severity": finding.severity,
        "message": finding.message,
        "evidence": finding.evidence,
        "fix": finding.fix,
        "step": finding.step,
    }


def _stage_rules(stage: str) -> list[str]:
    from hf_sanity import catalog

    return [rule.slug for rule in catalog.load().values() if rule.stage == stage]


def find_trainer(max_depth: int = 12):
    """The Trainer whose event is running: the first ``self`` up the stack that is a ``transformers.Trainer``."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        depth = 0
        while frame is not None and depth < max_depth:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
            depth += 1
    finally:
        del frame
    return None
