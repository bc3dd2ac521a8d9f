"""Preference data as the trainer trains on it: pairs (DPO and its variants, ORPO, CPO/SimPO, reward models)
and unpaired rows (KTO), measured once for the preference rules.

With a trainer, the token ids are the ones its own dataset preparation wrote (``prompt_ids``/``chosen_ids``/
``rejected_ids``; the reward trainer's ``chosen_ids``/``rejected_ids``; KTO's ``prompt_ids``/
``completion_ids``/``label``) and the cut is its collator's (``max_length``, ``truncation_mode``). Without one,
rows are tokenized the way TRL 1.16 does: a conversational prompt with the generation prompt, prompt and
completion rendered together, the completion starting where the two token sequences diverge; a text prompt and
completion tokenized as they are, EOS appended to text completions; an implicit prompt (no ``prompt`` column)
taken as the longest common prefix of chosen and rejected. Rows TRL drops without a word are counted: a prompt
that fills ``max_length`` alone (DPO, KTO), a reward pair with a side longer than ``max_length``.
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hf_sanity.measure.formats import extract_prompt, is_conversational
from hf_sanity.measure.markers import common_prefix

# TRL's defaults (1.16), for rows checked without a trainer.
DEFAULT_MAX_LENGTH = 1024
SCRIPT_SAMPLE = 256  # pairs whose completions are decoded for their script
PREFIX_SAMPLE = (
    64  # rows re-tokenized for TRL's prompt-prefix condition (a template's way: the same for every row)
)


def kept(prompt_len: int, completion_len: int, max_length: int | None, mode: str) -> int:
    """Completion tokens left after the collator cuts prompt + completion to ``max_length``."""
    if max_length is None:
        return completion_len
    if mode == "keep_end":
        return min(completion_len, max_length)
    return max(0, min(completion_len, max_length - prompt_len))


def cut(prompt: list[int], completion: list[int], max_length: int | None, mode: str) -> list[int]:
    """prompt + completion as the collator cuts it."""
    ids = prompt + completion
    if max_length is None or len(ids) <= max_length:
        return ids
    return ids[-max_length:] if mode == "keep_end" else ids[:max_length]


def script_of(text: str) -> str:
    """The dominant Unicode script of ``text``'s letters (LATIN, CJK, CYRILLIC, ...; "" without letters)."""
    counts: Counter[str] = Counter()
    for ch in text[:400]:
        if ch.isalpha():
            name = unicodedata.name(ch, "")
            counts[name.split(" ")[0] if name else "OTHER"] += 1
    return counts.most_common(1)[0][0] if counts else ""


@dataclass(frozen=True)
class Pairs:
    """One entry per pair the trainer trains on. ``*_len`` are token counts as prepared; ``*_kept`` the
    completion tokens left after the collator's cut; ``identical``: chosen and rejected are the same token
    sequence as the model is fed (``cause``: ``identical-text``, ``empty-completion`` or ``truncation``)."""

    prompt_len: np.ndarray
    chosen_len: np.ndarray
    rejected_len: np.ndarray
    chosen_kept: np.ndarray
    rejected_kept: np.ndarray
    shared_prefix: np.ndarray  # completion tokens chosen and rejected share from their start
    identical: np.ndarray
    cause: np.ndarray
    chosen_ends: np.ndarray  # the kept chosen completion ends with an end token (EOS / end of turn)
    rejected_ends: np.ndarray
    max_length: int | None
    truncation_mode: str = "keep_start"
    rows_given: int | None = None  # rows before the trainer dropped any
    dropped_prompt_fills: int = 0  # dropped by TRL: the prompt alone fills max_length
    dropped_too_long: int = 0  # reward pairs dropped by TRL: a side longer than max_length
    # Per pair: TRL's "tokenized prompt is not a prefix of the tokenized prompt+completion" (None: not measured)
    prefix_mismatch: np.ndarray | None = None
    chosen_script: list[str] = field(default_factory=list)  # the first pairs', from the decoded completion
    rejected_script: list[str] = field(default_factory=list)
    # The completion repeats the user/system turn (conversational, with a prompt)
    leaked: np.ndarray | None = None
    source: np.ndarray | None = None  # each pair's row in the dataset the user gave (None: the same index)
    gen_prompt_doubled: np.ndarray | None = None  # the completion opens with the assistant header again
    double_bos: np.ndarray | None = None  # the prompt starts with BOS twice

    def __len__(self) -> int:
        return len(self.prompt_len)


def measure_pairs(
    prompts: Sequence[list[int]],
    chosen: Sequence[list[int]],
    rejected: Sequence[list[int]],
    *,
    max_length: int | None,
    truncation_mode: str = "keep_start",
    end_ids: Iterable[int] = (),
    bos_id: int | None = None,
    header_ids: Sequence[int] = (),
    decode=None,
    same_text: Sequence[bool] | None = None,
    **extra: Any,
) -> Pairs:
    """The pairs' measurements from their token ids (``extra``: the counts and per-row flags measured on the
    way, see :class:`Pairs`). ``same_text``: per pair, chosen and rejected are the same text, for ids that
    arrive already cut (where equal ids do not say whether the text was)."""
    ends = set(end_ids)
    n = len(prompts)
    cols: dict[str, list] = {
        k: [] for k in ("p", "c", "r", "ck", "rk", "sp", "same", "cause", "ce", "re", "bos", "gp")
    }
    for i, (p, c, r) in enumerate(zip(prompts, chosen, rejected)):
        ck, rk = (
            kept(len(p), len(c), max_length, truncation_mode),
            kept(len(p), len(r), max_length, truncation_mode),
        )
        if truncation_mode == "keep_end":  # the cut may reach into the prompt
            same = cut(p, c, max_length, truncation_mode) == cut(p, r, max_length, truncation_mode)
        else:
            same = ck == rk and c[:ck] == r[:rk]
        cause = _identical_cause(c, r, None if same_text is None else bool(same_text[i])) if same else ""
        cols["p"].append(len(p))
        cols["c"].append(len(c))
        cols["r"].append(len(r))
        cols["ck"].append(ck)
        cols["rk"].append(rk)
        cols["sp"].append(common_prefix(c, r))
        cols["same"].append(same)
        cols["cause"].append(cause)
        cols["ce"].append(_ends(c, ck, truncation_mode, ends))
        cols["re"].append(_ends(r, rk, truncation_mode, ends))
        cols["bos"].append(bos_id is not None and len(p) >= 2 and p[0] == bos_id and p[1] == bos_id)
        cols["gp"].append(bool(header_ids) and _opens_with(c, header_ids) and _opens_with(r, header_ids))
    # Scripts from the first pairs only: decoding is the cost, and a share needs no more.
    scripts_c = [script_of(decode(c)) for c in chosen[:SCRIPT_SAMPLE]] if decode is not None else []
    scripts_r = [script_of(decode(r)) for r in rejected[:SCRIPT_SAMPLE]] if decode is not None else []
    as_int = lambda key: np.asarray(cols[key], dtype=np.int64)  # noqa: E731
    as_bool = lambda key: np.asarray(cols[key], dtype=bool)  # noqa: E731
    return Pairs(
        prompt_len=as_int("p"), chosen_len=as_int("c"), rejected_len=as_int("r"), chosen_kept=as_int("ck"),
        rejected_kept=as_int("rk"), shared_prefix=as_int("sp"), identical=as_bool("same"),
        cause=np.asarray(cols["cause"], dtype=object), chosen_ends=as_bool("ce"), rejected_ends=as_bool("re"),
        max_length=max_length, truncation_mode=truncation_mode, chosen_script=scripts_c,
        rejected_script=scripts_r, double_bos=as_bool("bos") if n else None,
        gen_prompt_doubled=as_bool("gp") if header_ids else None, **extra,
    )  # fmt: skip


def _identical_cause(chosen: list[int], rejected: list[int], same_text: bool | None) -> str:
    """Why a pair is identical as fed: its completions are empty, the same text, or cut where they agree."""
    if same_text is None:
        if not chosen and not rejected:
            return "empty-completion"
        same_text = chosen == rejected
    return "identical-text" if same_text else "truncation"


def _ends(completion: list[int], kept_tokens: int, mode: str, ends: set[int]) -> bool:
    """The kept completion ends on an end token (or on one and a newline after it, as ChatML renders a turn)."""
    if not kept_tokens:
        return False
    tail = completion[-kept_tokens:] if mode == "keep_end" else completion[:kept_tokens]
    return any(t in ends for t in tail[-2:])


def _opens_with(ids: Sequence[int], head: Sequence[int]) -> bool:
    return len(ids) >= len(head) and list(ids[: len(head)]) == list(head)


@dataclass(frozen=True)
class Unpaired:
    """KTO's rows in the order its sequential sampler feeds them: ``label`` (desirable or not), the batch size
    the trainer draws them in, and the rows TRL dropped."""

    label: np.ndarray
    batch_size: int
    prompt_len: np.ndarray
    completion_len: np.ndarray
    auto_unpaired: bool = False  # TRL unpaired a paired dataset itself (all chosen rows, then all rejected)
    rows_given: int | None = None
    dropped_prompt_fills: int = 0
    sequential: bool = True  # batches are drawn in order (KTO's KL term requires it): nothing reshuffles them
    source: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.label)


# -- tokenizing rows the way TRL does (no trainer) ---------------------------------------------------------
def _template_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    extra = row.get("chat_template_kwargs") or {}
    return {"tools": tools, **(extra if isinstance(extra, dict) else {})}


def _ids(tokenizer, value, **kwargs) -> list[int]:
    if isinstance(value, list):
        out = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, **kwargs)
        return list(out["input_ids"])
    return list(tokenizer(value)["input_ids"])


def tokenize_pair(
    tokenizer, row: dict[str, Any], *, reward: bool = False
) -> tuple[list[int], list[int], list[int], bool]:
    """(prompt ids, chosen ids, rejected ids, TRL's prompt-not-a-prefix condition) of one preference row, as
    TRL's DPOTrainer (or, with ``reward``, RewardTrainer: one sequence per side) tokenizes it."""
    chosen, rejected = row["chosen"], row["rejected"]
    prompt = row.get("prompt")
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    conversational = is_conversational(chosen) or is_conversational(rejected) or is_conversational(prompt)
    if not conversational:
        eos = tokenizer.eos_token or ""
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
    kwargs = _template_kwargs(row) if conversational else {}
    with_chosen = _ids(tokenizer, prompt + chosen, **kwargs)
    with_rejected = _ids(tokenizer, prompt + rejected, **kwargs)
    if reward:
        n = common_prefix(with_chosen, with_rejected)
        return with_chosen[:n], with_chosen[n:], with_rejected[n:], False
    prompt_ids = (
        _ids(tokenizer, prompt, add_generation_prompt=True, **kwargs)
        if conversational
        else _ids(tokenizer, prompt)
    )
    n = min(common_prefix(prompt_ids, with_chosen), common_prefix(prompt_ids, with_rejected))
    return prompt_ids[:n], with_chosen[n:], with_rejected[n:], n < len(prompt_ids)


def leaks_prompt(row: dict[str, Any]) -> bool:
    """The chosen or rejected side repeats the conversation's user or system turn although a ``prompt`` is given
    (TRL then renders the prompt twice), or a text completion starts with the prompt's text."""
    prompt = row.get("prompt")
    if prompt is None:
        return False
    for side in (row.get("chosen"), row.get("rejected")):
        if is_conversational(side) and any(m.get("role") in ("user", "system") for m in side):
            return True
        text_prompt = isinstance(prompt, str) and len(prompt.strip()) >= 20
        if isinstance(side, str) and text_prompt and side.lstrip().startswith(prompt.strip()):
            return True
    return False


# -- from a trainer, or from rows -----------------------------------------------------------------------
UNPAIR_BLOCK = (
    1000  # `unpair_preference_dataset` maps 1,000 pairs at a time: their chosen rows, then rejected
)


def source_rows(data) -> tuple[np.ndarray | None, int | None]:
    """For a dataset a trainer filtered: the original row of each kept row and the rows before the filter."""
    indices = getattr(data, "_indices", None)
    if indices is None:
        return None, None
    rows = np.asarray(indices.column(0).to_numpy(), dtype=np.int64)
    return rows, int(data.data.num_rows)


def end_ids(tokenizer, markers) -> set[int]:
    """The tokens a completion may end on: EOS, and the chat template's end of turn (with what follows it)."""
    ids = {tokenizer.eos_token_id} | set(markers.stop_ids) | set(markers.end_of_turn)
    return {i for i in ids if i is not None}


def looks_auto_unpaired(label: np.ndarray) -> bool:
    """The labels are what TRL's ``unpair_preference_dataset`` writes: per block of 1,000 pairs, every chosen row
    (desirable) then every rejected row."""
    if len(label) < 2:
        return False
    for start in range(0, len(label), 2 * UNPAIR_BLOCK):
        block = label[start : start + 2 * UNPAIR_BLOCK]
        half = len(block) // 2
        if len(block) % 2 or not block[:half].all() or block[half:].any():
            return False
    return True


def chosen_rows(prompts, chosen) -> list[dict[str, list[int]]]:
    """Each pair's chosen side as a training sequence: the prompt without loss, the completion with it (the rows
    the sequence rules read: EOS, truncation, BOS, special tokens)."""
    return [
        {"input_ids": list(p) + list(c), "labels": [-100] * len(p) + list(c)} for p, c in zip(prompts, chosen)
    ]


def read_columns(data, *names: str) -> list[list]:
    """Whole columns of a dataset as Python lists, read in one pass (iterating ``data[name]`` reads row by row),
    as stored: without the format a trainer set on it (TRL 0.24's reward trainer sets a transform)."""
    table = data.with_format(None).select_columns(list(names)).to_dict()
    return [table[name] for name in names]


def _stored_ids(value) -> list:
    return list(value.get("input_ids") or []) if isinstance(value, dict) else value


def trainer_pair_ids(trainer, *, reward: bool):
    """(prompts, chosen, rejected, max_length, truncation_mode, precut) as the trainer's dataset preparation wrote
    them: DPO's ``prompt_ids``/``chosen_ids``/``rejected_ids`` (cut later by its collator), the reward trainer's
    ``chosen_ids``/``rejected_ids`` (one sequence per side; longer pairs dropped, not cut), ORPO's and CPO's
    ``chosen_input_ids``/``chosen_labels``/... (already cut: ``precut``)."""
    data = trainer.train_dataset
    args = trainer.args
    columns = set(data.column_names)
    if {"chosen_input_ids", "chosen_labels", "rejected_input_ids"} <= columns:
        prompts, chosen, rejected = [], [], []
        for ids, labels, other in zip(
            data["chosen_input_ids"], data["chosen_labels"], data["rejected_input_ids"]
        ):
            n = sum(1 for label in labels if label == -100)
            prompts.append(ids[:n])
            chosen.append(ids[n:])
            rejected.append(other[n:])
        return prompts, chosen, rejected, None, "keep_start", True
    # The reward trainer of TRL 0.24 names them chosen_input_ids/rejected_input_ids (no labels: not precut).
    names = (
        ("chosen_ids", "rejected_ids")
        if "chosen_ids" in columns
        else ("chosen_input_ids", "rejected_input_ids")
    )
    # TRL 0.24 under transformers 5 stores apply_chat_template's dict in them: its input_ids are the ids.
    chosen, rejected = ([_stored_ids(v) for v in column] for column in read_columns(data, *names))
    if reward or "prompt_ids" not in columns:  # one sequence per side: the prompt is what both share
        prompts = [c[: common_prefix(c, r)] for c, r in zip(chosen, rejected)]
        chosen = [c[len(p) :] for c, p in zip(chosen, prompts)]
        rejected = [r[len(p) :] for r, p in zip(rejected, prompts)]
        return prompts, chosen, rejected, None, "keep_start", False
    mode = getattr(args, "truncation_mode", "keep_start") or "keep_start"
    (prompts,) = read_columns(data, "prompt_ids")
    return prompts, chosen, rejected, getattr(args, "max_length", None), mode, False


def pairs_from_trainer(trainer, *, tokenizer, markers, reward: bool, sample: int) -> tuple[Pairs, list[dict]]:
    """The pairs a DPO-family or reward trainer prepared, cut as its collator cuts them, and their chosen
    sides as training sequences."""
    data = trainer.train_dataset
    prompts, chosen, rejected, max_length, mode, precut = trainer_pair_ids(trainer, reward=reward)
    source, given = source_rows(data)
    # The rows as given, where the trainer kept them unchanged (the reward trainer writes prompt + chosen into
    # `chosen`): TRL's "tokenized prompt is not a prefix" condition (a sample: it re-tokenizes them) and the
    # completions that repeat the prompt.
    as_given = not reward and {"prompt", "chosen", "rejected"} <= set(data.column_names)
    raw = [data[i] for i in range(min(sample, PREFIX_SAMPLE, len(data)))] if as_given else []
    mismatch = (
        np.asarray([tokenize_pair(tokenizer, row)[3] for row in raw], dtype=bool)
        if raw and not precut
        else None
    )
    leaked = np.asarray([leaks_prompt(row) for row in raw], dtype=bool) if raw else None
    same_text = None
    if precut and {"chosen", "rejected"} <= set(data.column_names):
        same_text = np.asarray(
            [c == r for c, r in zip(*read_columns(data, "chosen", "rejected"))], dtype=bool
        )
    dropped = (given - len(data)) if given is not None else 0
    pairs = measure_pairs(
        prompts, chosen, rejected, max_length=max_length, truncation_mode=mode,
        end_ids=end_ids(tokenizer, markers), bos_id=tokenizer.bos_token_id, header_ids=markers.assistant_header,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), rows_given=given,
        dropped_prompt_fills=0 if reward else dropped, dropped_too_long=dropped if reward else 0,
        prefix_mismatch=mismatch, leaked=leaked, source=source, same_text=same_text,
    )  # fmt: skip
    return pairs, chosen_rows(prompts, chosen)


def pairs_from_rows(
    tokenizer, rows: Sequence[dict[str, Any]], *, markers, reward: bool, max_length: int | None,
    truncation_mode: str = "keep_start",
) -> tuple[Pairs, list[dict]]:  # fmt: skip
    """Preference rows tokenized as TRL would, without the rows it would drop (counted), and their chosen sides
    as training sequences."""
    tokenized = [tokenize_pair(tokenizer, row, reward=reward) for row in rows]
    keep = []
    for i, (p, c, r, _) in enumerate(tokenized):
        if reward:
            fits = max_length is None or max(len(p) + len(c), len(p) + len(r)) <= max_length
        else:
            fits = max_length is None or truncation_mode != "keep_start" or len(p) < max_length
        if fits:
            keep.append(i)
    dropped = len(rows) - len(keep)
    prompts, chosen, rejected = ([tokenized[i][k] for i in keep] for k in range(3))
    pairs = measure_pairs(
        prompts, chosen, rejected, max_length=None if reward else max_length, truncation_mode=truncation_mode,
        end_ids=end_ids(tokenizer, markers), bos_id=tokenizer.bos_token_id, header_ids=markers.assistant_header,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), rows_given=len(rows),
        dropped_prompt_fills=0 if reward else dropped, dropped_too_long=dropped if reward else 0,
        prefix_mismatch=None if reward else np.asarray([tokenized[i][3] for i in keep], dtype=bool),
        leaked=np.asarray([leaks_prompt(rows[i]) for i in keep], dtype=bool),
        source=np.asarray(keep, dtype=np.int64),
    )  # fmt: skip
    return pairs, chosen_rows(prompts, chosen)


KTO_BATCH_SIZE = (
    8  # KTOConfig's per_device_train_batch_size: the batches a dataset without a trainer is read in
)


def unpaired_rows(prompts, completions, label) -> list[dict[str, list[int]]]:
    """Each row as a training sequence; an undesirable completion carries no labels (it is no target)."""
    return [
        {"input_ids": list(p) + list(c), "labels": [-100] * len(p) + (list(c) if good else [-100] * len(c))}
        for p, c, good in zip(prompts, completions, label)
    ]


def unpaired_from_trainer(trainer) -> tuple[Unpaired, list[dict]]:
    """KTO's rows as its trainer prepared them, in the order its sequential sampler draws them."""
    data = trainer.train_dataset
    args = trainer.args
    label_column, prompts, completions = read_columns(data, "label", "prompt_ids", "completion_ids")
    label = np.asarray(label_column, dtype=bool)
    source, given = source_rows(data)
    sequential = getattr(args, "train_sampling_strategy", "sequential") == "sequential"
    unpaired = Unpaired(
        label=label,
        batch_size=int(getattr(args, "per_device_train_batch_size", KTO_BATCH_SIZE) or KTO_BATCH_SIZE),
        prompt_len=np.asarray([len(p) for p in prompts], dtype=np.int64),
        completion_len=np.asarray([len(c) for c in completions], dtype=np.int64),
        auto_unpaired=looks_auto_unpaired(label),
        rows_given=given,
        dropped_prompt_fills=(given - len(data)) if given is not None else 0,
        sequential=sequential,
        source=source,
    )
    return unpaired, unpaired_rows(prompts, completions, label)


def unpaired_from_rows(
    tokenizer, rows: Sequence[dict[str, Any]], *, max_length: int | None
) -> tuple[Unpaired, list[dict]]:
    """KTO rows (``prompt``/``completion``/``label``) tokenized as TRL would, in the order given."""
    tokenized = [
        tokenize_pair(tokenizer, {**row, "chosen": row["completion"], "rejected": row["completion"]})[:2]
        for row in rows
    ]
    keep = [i for i, (p, _) in enumerate(tokenized) if max_length is None or len(p) < max_length]
    prompts, completions = [tokenized[i][0] for i in keep], [tokenized[i][1] for i in keep]
    label = np.asarray([bool(rows[i]["label"]) for i in keep], dtype=bool)
    unpaired = Unpaired(
        label=label,
        batch_size=KTO_BATCH_SIZE,
        prompt_len=np.asarray([len(p) for p in prompts], dtype=np.int64),
        completion_len=np.asarray([len(c) for c in completions], dtype=np.int64),
        auto_unpaired=False,
        rows_given=len(rows),
        dropped_prompt_fills=len(rows) - len(keep),
        source=np.asarray(keep, dtype=np.int64),
    )
    return unpaired, unpaired_rows(prompts, completions, label)


def rows_context(tokenizer, dataset, *, objective, max_len: int | None, **context: Any):
    """The preflight context of a preference dataset checked without a trainer (the CLI, or
    ``preflight(dataset=...)``): its rows tokenized as TRL would (``max_len``: TRL's default when not given)."""
    import datasets

    from hf_sanity.measure.context import Context
    from hf_sanity.measure.encode import EncodeOptions
    from hf_sanity.measure.markers import derive_markers

    rows = dataset.to_list()
    max_len = DEFAULT_MAX_LENGTH if max_len is None else max_len
    pairs = unpaired = None
    if objective.kind == "preference-unpaired":
        unpaired, sequences = unpaired_from_rows(tokenizer, rows, max_length=max_len)
    else:
        markers = derive_markers(tokenizer)
        reward = objective.kind == "reward"
        pairs, sequences = pairs_from_rows(
            tokenizer, rows, markers=markers, reward=reward, max_length=max_len
        )
    data = (
        datasets.Dataset.from_list(sequences) if sequences else datasets.Dataset.from_dict({"input_ids": []})
    )
    return Context(
        tokenizer=tokenizer, dataset=data, fmt="tokens", options=EncodeOptions(fmt="tokens", max_len=max_len),
        objective=objective, pairs=pairs, unpaired=unpaired, **context,
    )  # fmt: skip


def separability(pairs) -> dict[str, float]:
    """The accuracy of each content-blind rule on the pairs (ties count as not separated)."""
    n = len(pairs)
    if n == 0:
        return {}
    out = {
        "longer-wins": float((pairs.chosen_len > pairs.rejected_len).mean()),
        "shorter-wins": float((pairs.chosen_len < pairs.rejected_len).mean()),
        "only-chosen-ends": float((pairs.chosen_ends & ~pairs.rejected_ends).mean()),
        "only-rejected-ends": float((pairs.rejected_ends & ~pairs.chosen_ends).mean()),
    }
    if pairs.chosen_script and pairs.rejected_script:  # measured on the first pairs
        c, r = np.asarray(pairs.chosen_script), np.asarray(pairs.rejected_script)
        for script in set(pairs.chosen_script) - {""}:
            out[f"chosen-is-{script.lower()}"] = float(((c == script) & (r != script)).mean())
    return out
