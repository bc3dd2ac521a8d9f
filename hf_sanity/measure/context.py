"""The shared, cached context every preflight rule reads.

Load once -> tokenize and measure once (``encoded``) -> each rule reads columns and yields findings.
Model work (a forward pass over a bounded sample) is done once, lazily, only if a rule asks for it.

Rules only read it: after construction the context refuses attribute writes, and what it measures lazily
(cached properties) is the same whichever rule asks first, so no rule can change what a later one sees.
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Callable, Sequence
from functools import cached_property, lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from hf_sanity import progress
from hf_sanity.measure.encode import MEASURES, EncodeOptions, Encoder, template_kwargs
from hf_sanity.measure.families import own_families
from hf_sanity.measure.formats import conversation_of, read_as
from hf_sanity.measure.generate import served_stop_ids
from hf_sanity.measure.loss_mask import of_format
from hf_sanity.measure.losses import token_loss
from hf_sanity.measure.markers import Span, TemplateMarkers, derive_markers
from hf_sanity.measure.objective import SFT_OBJECTIVE
from hf_sanity.measure.tensors import pad_batches, pad_id
from hf_sanity.tokenview import TokenView

CALIBRATION_ROWS = 64
IN_MEMORY_ROWS = 256  # a dataset this small is encoded in memory, without a cache file
ABLATION_EXAMPLES = 16  # examples whose prompts are blanked to see what the prompt contributes (a cause)
# Examples whose whole input is blanked for `input-ignored`: it looks for losses equal to rounding, which a model
# that reads its input never gives on any number of positions, so a few examples decide it.
INPUT_ABLATION_EXAMPLES = 4
INPUT_ABLATION_TOKENS = 64  # positions scored per variant there
# Sampled examples the step-0 loss is measured on: its 512 scored positions (`losses.SCORED_TOKENS`), 16 per
# example, need no more (the transformer runs on every one of them).
INIT_LOSS_EXAMPLES = 32
STEP_ROWS = 2  # rows of the first batch the trainer's own compute_loss is measured on (`trainer_step`)
# Conversations whose last answers are scored in the template and as plain text: a paired comparison on the same
# answer tokens (256 positions each way, 16 per conversation) that looks for a gap of 0.5 nat and 50%.
TEMPLATE_EXAMPLES = 16


class _Mapped:
    """The encoder as ``datasets.map`` calls it: its columns handed over as one Arrow table of fixed types
    (:func:`arrow_schema`), each batch counted in the progress phase when ``counted`` (this process only).

    Fixed types, because datasets infers a column's type from the first batch: a list column empty in every
    row of the first batch (no stray marker in its first 256 rows) would become ``list<null>``, and the first
    later row with a value could not be written. And no per-value inference: it is faster."""

    def __init__(self, encoder, counted: bool = False) -> None:
        self.encoder, self.counted = encoder, counted

    def __call__(self, batch: dict[str, list]):
        table = to_arrow(self.encoder(batch))
        if self.counted:
            progress.advance(len(next(iter(batch.values()), ())))
        return table


# The list columns' item types (``input_ids`` in int32, as datasets stores a column of that name).
LIST_ITEMS = {
    "input_ids": "int32",
    "labels": "int64",
    "spans": "int64",
    "special_ids": "int64",
    "content_markers": "string",
    "text_families": "string",
}


@lru_cache(maxsize=1)
def arrow_schema():
    """The Arrow type of every column the encoder writes (``encode.MEASURES``)."""
    import pyarrow as pa

    def scalar(empty):
        return {bool: pa.bool_(), int: pa.int64(), float: pa.float64(), str: pa.string()}[type(empty)]

    return pa.schema(
        [
            (key, pa.list_(pa.type_for_alias(LIST_ITEMS[key])) if key in LIST_ITEMS else scalar(empty))
            for key, empty in MEASURES.items()
        ]
    )


def to_arrow(columns: dict[str, list]):
    """The encoder's columns as an Arrow table of :func:`arrow_schema`'s types; a column whose values do not
    fit its type (token ids beyond int32) keeps the type Arrow infers for it."""
    import pyarrow as pa

    schema = arrow_schema()
    arrays = []
    for field in schema:
        try:
            arrays.append(pa.array(columns[field.name], type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            arrays.append(pa.array(columns[field.name]))
    return pa.Table.from_arrays(arrays, names=schema.names)


class Context:
    def __init__(
        self,
        *,
        tokenizer,
        dataset=None,
        fmt: str = "messages",
        options: EncodeOptions | None = None,
        model=None,
        model_loader: Callable[[], Any] | None = None,
        eval_dataset=None,
        inference_tokenizer=None,
        adapter_path: str | None = None,
        trainer=None,
        sample: int = 256,
        num_proc: int | None = None,
        encoded=None,
        model_config=None,
        shard: bool = False,
        first_batch=None,
        init_loss: dict[str, float] | None = None,
        generation_config=None,
        task: str = "generative",
        rows_given: int | None = None,
        served_model=None,
        objective=None,
        pairs=None,
        unpaired=None,
        rl=None,
        prompts=None,
        loss_mask=None,
        modality=None,
        image_digests=None,
        refused_batches=(),
    ):
        store = super().__setattr__
        store("tokenizer", tokenizer)
        store("dataset", dataset)
        # The rules read what TRL reads: a ShareGPT dataset is `messages`, an Alpaca one `prompt-completion`.
        store("fmt", read_as(fmt))
        store("source_format", fmt)
        store("options", options or EncodeOptions(fmt=fmt))
        # Which tokens the run puts in the loss and why (`measure.loss_mask`): the trainer's, or what TRL does
        # with the format unless the options say otherwise (prompt-in-loss reads it; the report states it).
        columns = getattr(dataset, "column_names", None) or ()
        store(
            "loss_mask",
            loss_mask or of_format(read_as(fmt), self.options.loss_on, has_labels="labels" in columns),
        )
        # "extractive": answers quote the prompt on purpose (extractive QA, RAG with citations).
        store("task", task)
        store("_model", model)
        store("_model_loader", model_loader)
        store("eval_dataset", eval_dataset)
        store("inference_tokenizer", inference_tokenizer)
        store("adapter_path", adapter_path)
        store("trainer", trainer)
        store("sample", sample)
        store("num_proc", num_proc)
        store("_config", model_config)
        # With a trainer: its first collated batch, exactly as the model receives it.
        store("first_batch", first_batch)
        store("_given_init_loss", init_loss)
        # With an adapter: the model that is served in its place (merged and reloaded), to compare with the
        # model + adapter that was trained.
        store("served_model", served_model)
        store("_rows_given", rows_given)  # with a trainer: the rows of the dataset the user passed it
        # What the run trains for (`measure.objective`); preference data as the trainer trains on it: the pairs
        # (DPO family, reward models) or KTO's unpaired rows (`measure.preference`). The rows of ``dataset`` are
        # then the sequences of each pair's chosen side (KTO: every row, undesirable ones without labels).
        store("objective", objective or SFT_OBJECTIVE)
        store("pairs", pairs)
        store("unpaired", unpaired)
        store(
            "rl", rl
        )  # an RL trainer's rollouts and reward functions, measured lazily (`measure.rl.Rollouts`)
        # RL: the prompts as given (a dataset with a `prompt` column): the trainer's train_dataset, or a
        # prompt-only file; the rules that re-render conversations read them.
        store("prompts", prompts)
        store("_generation_config", generation_config)
        # Text, or vision-language (`measure.vision`): measured once where the context is built.
        store("_modality", modality)
        # Vision-language rows: a digest of each row's own pictures (None where not known), part of the row.
        store("image_digests", image_digests)
        # With a VLM trainer: the errors of the batches its collator refused while preflight drew them.
        store("refused_batches", list(refused_batches))
        store("reencode_rows", False)
        store("_scratch_dir", None)
        # Under torchrun, scan only this process's shard and judge on rank 0 (see measure.distributed).
        store("shard", shard)
        store("_columns", {})
        if encoded is not None:
            self.__dict__["encoded"] = encoded

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"the preflight context is read-only (a rule tried to set {name!r})")

    # -- tokens ------------------------------------------------------------------------------------
    @cached_property
    def markers(self) -> TemplateMarkers:
        return derive_markers(self.tokenizer)

    @cached_property
    def own_families(self) -> frozenset[str]:
        return own_families(self.tokenizer)

    @cached_property
    def encoder(self) -> Encoder:
        encoder = Encoder(self.tokenizer, self.options, self.markers)
        if self.dataset is not None and self.fmt in ("messages", "prompt-completion"):
            encoder.calibrate(self.dataset.select(range(min(CALIBRATION_ROWS, len(self.dataset)))).to_list())
        return encoder

    @cached_property
    def encoded(self):
        """The dataset as training tokens plus one column per measurement (see ``encode.MEASURES``)."""
        return self._encode(self.dataset)

    @cached_property
    def eval_encoded(self):
        return None if self.eval_dataset is None else self._encode(self.eval_dataset)

    def _encode(self, dataset):
        from hf_sanity.measure import distributed

        rank, size = distributed.world() if self.shard else (0, 1)
        if size == 1:
            return self._map(dataset)
        # Each process encodes a contiguous shard; rank 0 gets every measurement (not the tokens).
        shard = self._map(dataset.shard(num_shards=size, index=rank, contiguous=True))
        light = shard.remove_columns(["input_ids", "labels"])
        merged = distributed.gather_columns(light.to_dict())
        super().__setattr__("reencode_rows", True)
        if merged is None:
            return None
        import datasets

        return datasets.Dataset.from_dict(merged)

    def _map(self, dataset):
        import datasets

        # datasets' own bar never shows: on a terminal hf-sanity's display counts the rows (datasets' would draw
        # over it); piped, redirected or from Python nothing extra is printed.
        quiet = not datasets.utils.are_progress_bars_disabled()
        if quiet:
            datasets.disable_progress_bars()
        counted = progress.active() and not (self.num_proc and self.num_proc > 1)  # other processes: no count
        try:
            with progress.phase(f"tokenizing {len(dataset):,} rows", total=len(dataset) if counted else None):
                return self._map_rows(dataset, _Mapped(self.encoder, counted))
        finally:
            if quiet:
                datasets.enable_progress_bars()

    def _map_rows(self, dataset, encode):
        # A few rows (a training run's first batch, a sample) are encoded in one call, in memory: datasets.map's
        # cache file and per-call schema work cost more than encoding them (~20 ms against ~2 ms for 16 rows).
        small = len(dataset) <= IN_MEMORY_ROWS and not (self.num_proc and self.num_proc > 1)
        if small and len(dataset):  # one batch, as map would pass it: its Arrow table is the Dataset
            import datasets

            return datasets.Dataset(encode(dataset[:]), fingerprint=uuid.uuid4().hex)
        return dataset.map(
            encode,
            batched=True,
            batch_size=256,
            num_proc=self.num_proc if self.num_proc and self.num_proc > 1 else None,
            remove_columns=dataset.column_names,
            desc="hf-sanity: tokenizing",
            load_from_cache_file=False,
            new_fingerprint=uuid.uuid4().hex,  # hashing the encoder (and its tokenizer) costs more than it saves
            keep_in_memory=small,
            # datasets would write its cache file next to the data (a save_to_disk folder is the user's):
            # ours goes to a scratch folder that lives as long as this context.
            cache_file_name=None if small else str(self._scratch() / f"{uuid.uuid4().hex}.arrow"),
        )

    def _scratch(self) -> Path:
        if self._scratch_dir is None:
            super().__setattr__("_scratch_dir", tempfile.TemporaryDirectory(prefix="hf-sanity-preflight-"))
        return Path(self._scratch_dir.name)

    def __len__(self) -> int:
        return len(self.encoded)

    @property
    def rows_are_dataset(self) -> bool:
        """Row ``i`` of the measurements is row ``i`` of the dataset as given (preflight on SFT rows), so a
        remedy may drop or edit rows by index; not on a trainer's batches, nor on preference pairs."""
        return (
            self.trainer is None and self.dataset is not None and self.pairs is None and self.unpaired is None
        )

    def col(self, name: str) -> np.ndarray:
        """One scalar measurement for every example, as an array (read once from Arrow, cached)."""
        if name not in self._columns:
            self._columns[name] = self.encoded.data.column(name).to_numpy(zero_copy_only=False)
        return self._columns[name]

    def values(self, name: str) -> list:
        """One list-valued measurement for every example (e.g. ``special_ids``), as Python lists."""
        return self.encoded.data.column(name).to_pylist()

    def distinct(self, name: str) -> list:
        """The distinct items of a list-valued measurement over every example, sorted (read in Arrow: turning
        every row's list into Python cost ~0.1 s per 1,000 conversations)."""
        import pyarrow.compute as pc

        column = self.encoded.data.column(name)
        return sorted(item for item in pc.unique(pc.list_flatten(column)).to_pylist() if item is not None)

    @cached_property
    def valid(self) -> np.ndarray:
        """Rows that encoded (no ``error``)."""
        return self.col("error") == ""

    def conversation(self, index: int) -> list[dict] | None:
        """Row ``index`` as the messages the chat template renders (None for plain text or a broken row)."""
        row = self.encoder.layout.to_trl(self.dataset[int(index)])
        return conversation_of(row) if isinstance(row, dict) else None

    def template_kwargs(self, index: int) -> dict[str, Any]:
        """What the chat template renders row ``index`` with besides its messages (its ``tools``, its
        ``chat_template_kwargs``), as TRL passes them; {} for a row without them or with broken ones."""
        row = self.encoder.layout.to_trl(self.dataset[int(index)])
        kwargs = template_kwargs(row) if isinstance(row, dict) else {}
        return kwargs if isinstance(kwargs, dict) else {}

    def row(self, index: int) -> dict[str, Any]:
        if self.reencode_rows:  # distributed: rank 0 holds measurements only; encode the one row shown
            return self.encoder.encode(self.dataset[int(index)])
        return self.encoded[int(index)]

    def spans(self, index: int) -> list[Span]:
        flat = self.row(index)["spans"]
        return [Span(*flat[i : i + 4]) for i in range(0, len(flat), 4)]

    def view(self, index: int, *, focus: int | None = None, title: str | None = None) -> TokenView:
        """The token view of one encoded example (positions from max_len on are marked cut)."""
        row = self.row(index)
        return TokenView.from_ids(
            self.tokenizer,
            row["input_ids"],
            row["labels"],
            focus=focus,
            title=title or f"example {int(index)}",
            cut=self.options.max_len,
        )

    def first(self, mask: np.ndarray, limit: int = 10) -> list[int]:
        return [int(i) for i in np.flatnonzero(mask)[:limit]]

    @cached_property
    def trainer_rows(self) -> tuple[int, int] | None:
        """(rows the user passed, rows the trainer trains on) when a trainer without packing dropped some: TRL
        drops the examples its truncation left without a completion token. The rows passed are ``rows_given``,
        else read from the trainer's dataset, whose ``filter`` keeps the table it selected from."""
        from hf_sanity.measure.frameworks import of_trainer

        data = getattr(self.trainer, "train_dataset", None)
        # Packed rows are packs, not examples (and TRL drops no row when it packs).
        packed = getattr(getattr(self.trainer, "args", None), "packing", False)
        if data is None or packed or not self.options.arrived_cut_at or not hasattr(data, "__len__"):
            return None
        if not of_trainer(self.trainer).trainer_drops:
            return None  # the framework's preparation filtered the rows, not its trainer (Axolotl)
        given = self._rows_given
        if given is None and getattr(data, "_indices", None) is not None:
            given = data.data.num_rows  # the table `filter` selected from: the rows before it dropped any
        return (given, len(data)) if given is not None and given > len(data) else None

    @cached_property
    def attention(self):
        """The facts of the first collated batch's attention mask (see ``measure.attention``), or None without
        a batch."""
        from hf_sanity.measure.attention import attention_facts

        if self.first_batch is None:
            return None
        tok = self.tokenizer
        ends = set(self.markers.stop_ids) | {tok.eos_token_id}
        return attention_facts(
            self.first_batch, pad_id=tok.pad_token_id, end_ids=ends, bos_id=tok.bos_token_id
        )

    @cached_property
    def left_padding_shift(self) -> dict[str, Any] | None:
        """The first left-padded example of the first batch, run padded and alone (``forwards``); None
        without one (or with position_ids given), or without a model."""
        from hf_sanity.measure.forwards import left_padding_shift

        facts = self.attention
        if facts is None or not facts.left_padded_rows or facts.position_ids_given or not self.has_model:
            return None
        return left_padding_shift(self.model, self.first_batch, facts.left_padded_rows[0])

    @cached_property
    def splits(self):
        """Train against eval (``measure.splits``): keys, distances against random re-splits, what eval holds
        that train does not; None without an eval dataset."""
        from hf_sanity.measure.splits import compare_splits, split_rows

        if self.eval_dataset is None:
            return None
        layout = self.encoder.layout
        common = dict(alpaca_template=layout.alpaca_template, has_template=self.markers.has_template)
        train = split_rows(self.dataset, self.encoded, fmt=self.source_format, **common)
        return compare_splits(train, split_rows(self.eval_dataset, self.eval_encoded, fmt=None, **common))

    @cached_property
    def future_leak(self) -> dict[str, Any] | None:
        """How far the logits at positions <= t move when only the tokens after t change (``measure.causal``):
        on the first collated batch as the model receives it, else on a right-padded batch of sampled
        examples; None without a model or a row to check."""
        from hf_sanity.measure.causal import LEAK_ROWS, future_token_leak

        if not self.has_model:
            return None
        batch = self.first_batch
        if batch is None:
            batches = self.sample_batches(batch_size=LEAK_ROWS, limit=LEAK_ROWS)
            batch = batches[0] if batches else None
        if batch is None:
            return None
        return self.unless_image_cut(
            lambda: future_token_leak(self.model, batch, vision_ids=self.modality.vision_ids)
        )

    def unless_image_cut(self, forward):
        """``forward()``, or None when it raises on a VLM batch while ``max_length`` cuts image spans: the model
        (or TRL's compute_loss) refuses placeholders cut from their features, which `image-span-truncated`
        reports; no forward of that batch can be measured."""
        try:
            return forward()
        except (ValueError, RuntimeError):
            spans = self.image_spans if self.modality.is_vision else None
            if spans is not None and spans.cut:
                return None
            raise

    @cached_property
    def served(self):
        """The served model against the trained one (the model with the saved adapter attached) and the base
        (the model alone), on the first sample batch and weight by weight (see ``measure.served``); None
        without a served model, an adapter or a sample."""
        from hf_sanity.measure.adapters import attached_adapter
        from hf_sanity.measure.served import compare_served, logits

        if self.served_model is None or not self.adapter_path or not self.has_model:
            return None
        batches = self.sample_batches(batch_size=4)
        if not batches:
            return None
        batch = {k: v for k, v in batches[0].items() if k != "labels"}
        base_logits = logits(self.model, batch)  # before the adapter's layers go into the model
        with attached_adapter(self.model, self.adapter_path) as trained:
            return compare_served(trained, self.served_model, batch, base_logits=base_logits)

    @cached_property
    def adapter_changes_outputs(self) -> bool | None:
        """Whether the adapter changes the model's logits on the first sample batch: the saved one
        (``--adapter``) attached against the model alone, else the model's own adapter against it disabled
        (``measure.adapters``); None without a model, an adapter or a sample."""
        from hf_sanity.measure.adapters import attached_adapter_changes_outputs, saved_adapter_changes_outputs

        batches = self.sample_batches(batch_size=4) if self.has_model else []
        if not batches:
            return None
        if self.adapter_path:
            return saved_adapter_changes_outputs(self.model, self.adapter_path, batches[0])
        if getattr(self.model, "peft_config", None) and hasattr(self.model, "disable_adapter"):
            return attached_adapter_changes_outputs(self.model, batches[0])
        return None

    @property
    def modality(self):
        from hf_sanity.measure.vision import TEXT_MODALITY

        return self._modality or TEXT_MODALITY

    @cached_property
    def vision_tokens(self):
        """Per row: its vision tokens and those that carry loss (`measure.vision.VisionTokens`)."""
        from hf_sanity.measure.vision import vision_tokens

        return vision_tokens(self.encoded, self.modality)

    @cached_property
    def image_spans(self):
        """With a VLM trainer: its dataset's rows whose image placeholders max_length cuts (`measure.vision`)."""
        from hf_sanity.measure.vision import image_spans

        if self.trainer is None or not self.modality.is_vision:
            return None
        return image_spans(self.trainer, self.modality, self.refused_batches)

    @cached_property
    def adapter_towers(self):
        """With a PEFT model (the trainer's, or the model given): where its adapter layers are and what trains,
        per tower of a vision-language model (`measure.towers`); None without one."""
        from hf_sanity.measure.towers import adapter_towers

        return adapter_towers(self.peft_model) if self.peft_model is not None else None

    @property
    def peft_model(self):
        """The trainer's model, or the model object given, when it carries a PEFT config; else None."""
        model = self.trainer.model if self.trainer is not None else self._model
        return model if isinstance(getattr(model, "peft_config", None), dict) else None

    # -- model -------------------------------------------------------------------------------------
    @property
    def has_model(self) -> bool:
        return self._model is not None or self._model_loader is not None

    @property
    def model_given(self) -> bool:
        """The user handed in a model object (a loaded model may have been resized, frozen, wrapped); a model
        given by path or loader is loaded as saved."""
        return self._model is not None

    @cached_property
    def model_config(self):
        """The model's config, without loading weights when it was given as a path."""
        if self._config is not None:
            return self._config
        if self._model is not None:
            return getattr(self._model, "config", None)
        return self.model.config if self.has_model else None

    @cached_property
    def model(self):
        if self._model is not None:
            return self._model
        return self._model_loader() if self._model_loader is not None else None

    @cached_property
    def generation_stop_ids(self) -> frozenset[int] | None:
        """The token ids that end generation at serving time: the generation config's ``eos_token_id`` (given,
        or the model object's), what ``model.generate`` stops on (not the tokenizer's EOS: generate does not read
        the tokenizer); None when no generation config is known. With an RL trainer, the ids its rollouts stop
        on (`measure.rl.stop_ids`)."""
        if self.objective.kind == "rl" and self.trainer is not None:  # what the trainer's rollouts stop on
            from hf_sanity.measure.rl import stop_ids

            return frozenset(stop_ids(self.trainer))
        config = self._generation_config
        if config is None and self._model is not None:
            config = getattr(self._model, "generation_config", None)
        return served_stop_ids(config)

    @cached_property
    def embedding_rows(self) -> int | None:
        """The model's input-embedding rows: from the model object when given (it may have been resized), else
        from the config, loading the model only when there is neither."""
        if not self.model_given and self.model_config is not None:
            config = self.model_config
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            return getattr(text, "vocab_size", None)
        getter = getattr(self.model, "get_input_embeddings", None) if self.has_model else None
        if getter is None:  # no model, or a hand-written module that does not say which layer embeds
            return None
        embeddings = self.input_embeddings
        return int(embeddings.num_embeddings) if embeddings is not None else None

    @cached_property
    def input_embeddings(self):
        """The model's input embedding module; None without a model, or for a model that does not expose one
        (a custom ``nn.Module`` without ``get_input_embeddings``: the embedding checks cannot measure it)."""
        get = getattr(self.model, "get_input_embeddings", None) if self.has_model else None
        try:
            embeddings = get() if get is not None else None
        except NotImplementedError:  # transformers' default for a model that has none
            return None
        return embeddings if hasattr(embeddings, "weight") else None

    @contextlib.contextmanager
    def model_as_trained(self):
        """The model as the training steps run it: with a saved adapter (``--adapter``), the adapter attached
        for the block and removed after (the model object and the folders are left as they were); else the
        model itself. The checks that run the model (the step-0 loss, the input ablation, template against
        text) score this one."""
        if self.adapter_path and self.has_model:
            from hf_sanity.measure.adapters import attached_adapter

            with attached_adapter(self.model, self.adapter_path) as trained:
                yield trained
        else:
            yield self.model

    @cached_property
    def sample_indices(self) -> list[int]:
        """A bounded, evenly spread sample of valid rows for model-side checks."""
        valid = np.flatnonzero(self.valid & (self.col("n_supervised_kept") > 0))
        if len(valid) <= self.sample:
            return [int(i) for i in valid]
        picks = np.linspace(0, len(valid) - 1, self.sample).round().astype(int)
        return [int(valid[i]) for i in picks]

    def sample_batches(
        self, batch_size: int = 8, *, by_length: bool = False, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """The sampled examples (the first ``limit``), truncated to max_len, padded, as tensor batches
        (``pad_batches``)."""
        return self.batches(self.sample_seqs(limit), batch_size, by_length=by_length)

    def sample_seqs(self, limit: int | None = None) -> list[tuple[list[int], list[int]]]:
        """(input_ids, labels) of the sampled examples (the first ``limit``), truncated to max_len."""
        max_len = self.options.max_len
        rows = [self.row(i) for i in self.sample_indices[:limit]]
        return [(r["input_ids"][:max_len], r["labels"][:max_len]) for r in rows]

    def batches(
        self, seqs: Sequence[tuple[list[int], list[int]]], batch_size: int = 8, *, by_length: bool = False
    ) -> list[dict[str, Any]]:
        """(input_ids, labels) pairs as right-padded tensor batches (``by_length``: see ``pad_batches``)."""
        return pad_batches(seqs, pad_id(self.tokenizer), batch_size, by_length=by_length)

    @cached_property
    def ablation(self):
        """Sampled examples with their prompts blanked (``forwards.InputAblation``: each variant measured once,
        when a rule first reads it); None without a model or a sample."""
        return self._ablation(ABLATION_EXAMPLES)

    @cached_property
    def input_check_ablation(self):
        """The first few sampled examples with their whole input blanked (``INPUT_ABLATION_EXAMPLES``)."""
        return self._ablation(INPUT_ABLATION_EXAMPLES, max_tokens=INPUT_ABLATION_TOKENS)

    def _ablation(self, examples: int, **options):
        from hf_sanity.measure.forwards import InputAblation

        if not self.has_model or not self.sample_indices:
            return None
        seqs = self.sample_seqs(examples)
        batches = partial(self.batches, by_length=True)
        return InputAblation(self.model_as_trained, self.tokenizer, seqs, batches, **options)

    @cached_property
    def template_against_text(self) -> dict[str, Any] | None:
        """The sampled conversations' last answers scored in the chat template and after the same content as
        plain text, by the model as trained (``forwards.template_against_text``); None without a model, without
        conversations, or with fewer than two that end in an answer."""
        from hf_sanity.measure.forwards import template_against_text

        if not self.has_model or self.fmt not in ("messages", "prompt-completion") or self.dataset is None:
            return None
        examples = (
            (self.conversation(i), self.spans(i), self.row(i)["input_ids"])
            for i in self.sample_indices[:TEMPLATE_EXAMPLES]
        )
        return template_against_text(
            examples,
            self.tokenizer,
            self.markers.stop_ids,
            self.model_as_trained,
            partial(self.batches, by_length=True),
        )

    @property
    def input_ablation(self) -> dict[str, Any] | None:
        """The examples as they are and with their whole input blanked; None without supervised tokens."""
        ablation = self.input_check_ablation
        return ablation.measured("as_is", "input_blanked") if ablation is not None else None

    @property
    def prompt_ablation(self) -> dict[str, Any] | None:
        """The examples as they are and with their prompts blanked, and how much of each answer its prompt
        holds; None without supervised tokens."""
        return self.ablation.measured("as_is", "prompt_blanked") if self.ablation is not None else None

    @property
    def step0_given(self) -> bool:
        """The step-0 numbers came with the context (the callback measured them on the first real step)."""
        return self._given_init_loss is not None

    @cached_property
    def trainer_step(self):
        """What the trainer's own compute_loss makes of the first rows of its first batch (``STEP_ROWS``, with
        their pictures; the whole batch where its rows cannot be taken apart): the loss, and what the model's
        forward returned inside it (``forwards.trainer_step``). A scaled or replaced loss, or a router's
        load-balancing term, shows on two rows as on all; the vocabulary projection of a whole batch, TRL's
        included, was the measurement's cost. None without a trainer and a batch with labels, or when the batch
        holds image spans `max_length` cut (`unless_image_cut`)."""
        from hf_sanity.measure.forwards import trainer_step
        from hf_sanity.measure.vision import leading_rows

        trainer, batch = self.trainer, self.first_batch
        if trainer is None or batch is None or "labels" not in batch or not hasattr(trainer, "compute_loss"):
            return None
        rows = leading_rows(batch, STEP_ROWS, self.modality.placeholder_ids) or batch
        return self.unless_image_cut(lambda: trainer_step(trainer, rows))

    @cached_property
    def packed_against_alone(self):
        """With a trainer: the second example of the first packed row of its first batch, its logits packed
        against alone (``trainer_setup.packed_against_alone``); None without a packed row."""
        from hf_sanity.measure.trainer_setup import packed_against_alone

        if self.trainer is None or self.first_batch is None:
            return None
        return packed_against_alone(self.trainer.model, self.first_batch)

    @cached_property
    def items_scaling(self):
        """With gradient accumulation: whether the trainer's compute_loss scales by ``num_items_in_batch`` on its
        first batch (``trainer_setup.items_scaling``); None without accumulation or a batch with labels."""
        from hf_sanity.measure.trainer_setup import items_scaling

        trainer, batch = self.trainer, self.first_batch
        if trainer is None or batch is None or trainer.args.gradient_accumulation_steps <= 1:
            return None
        return items_scaling(trainer, batch) if "labels" in batch else None

    @cached_property
    def checkpointing_grads(self):
        """With activation checkpointing on: which trainable tensors one forward/backward of the trainer's first
        batch reaches (``trainer_setup.grads_reached``); None with it off, or without a batch with labels."""
        from hf_sanity.measure.trainer_setup import checkpointing_on, grads_reached

        trainer, batch = self.trainer, self.first_batch
        if trainer is None or batch is None or "labels" not in batch or not checkpointing_on(trainer.model):
            return None
        return grads_reached(trainer.model, batch)

    @property
    def trainer_loss(self) -> float | None:
        """What the trainer's own compute_loss returns on its first batch (``trainer_step``)."""
        return self.trainer_step.loss if self.trainer_step is not None else None

    @property
    def step0_measured(self) -> dict[str, Any] | None:
        """The step-0 numbers if a rule measured them (``init_loss``), without measuring them."""
        return self.__dict__.get("init_loss")

    @cached_property
    def init_loss(self) -> dict[str, float] | None:
        """The step-0 loss over the supervised tokens of the sample and what `init-loss-off-chance` reads beside
        it (``token_loss(detail=True)``; one no-grad pass of the model as trained, state kept), or the step-0
        numbers the context was built with (the callback measures them on the first batch)."""
        if self._given_init_loss is not None:
            return dict(self._given_init_loss)
        if not self.has_model or not self.sample_indices:
            return None
        batches = self.sample_batches(by_length=True, limit=INIT_LOSS_EXAMPLES)
        with self.model_as_trained() as model:
            return token_loss(model, batches, detail=True)
