"""Where turns begin and end, derived from the tokenizer's own chat template (no family is hard-coded).

Rendering a probe conversation tells us, in token ids as they appear in context:

* the *assistant header*: what the template puts between the end of a user message and the point where the
  model starts generating: the end of the generation prompt (``<|im_end|>\\n<|im_start|>assistant\\n`` for
  ChatML, `` [/INST]`` for Mistral). What a template writes into a completed assistant turn after that point
  (Qwen3's empty ``<think>\\n\\n</think>\\n\\n`` block) is completion: the model writes it at inference;
* the *end of turn*: the first tokens after an assistant answer (``<|im_end|>``, ``<|eot_id|>``, ``</s>``);
* the *generation prompt* in tokens, as inference renders it after the user's turn: every training turn
  must start with the same tokens, or inference prompts the model into a state it never trained in
  (DeepSeek-R1's ``<|Assistant|><think>\\n`` where its training turns have ``<|Assistant|>`` and the answer).

With these, assistant turns can be located in any token sequence: pre-tokenized datasets, text datasets that
carry the template's markers, and the collated batches of a real Trainer.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PROBE_USER = "Probe question zq"
PROBE_ASSISTANT = "Probe answer zq"


@dataclass(frozen=True)
class Span:
    """One completion in token positions: ``[start, stop)`` carries the answer and its end-of-turn token;
    ``[lead, start)`` is the assistant turn's own scaffolding before it (its header, the newline after it) and
    ``[stop, end)`` template whitespace after it: both are the assistant's side of the conversation, neither
    prompt nor completion (training on them does not teach the model to write the user's turns)."""

    lead: int
    start: int
    stop: int
    end: int

    def flat(self) -> tuple[int, int, int, int]:
        return self.lead, self.start, self.stop, self.end


@dataclass(frozen=True)
class TemplateMarkers:
    has_template: bool
    assistant_header: tuple[int, ...] = ()
    header_own: int = 0  # the header's last tokens that open the assistant turn (the rest closes the user's)
    end_of_turn: tuple[int, ...] = ()
    generation_ids: tuple[int, ...] = ()  # the generation prompt's tokens after the user's turn, at inference
    turn_marker_ids: frozenset[int] = frozenset()  # special tokens the template uses as turn/role boundaries
    probe_render: str = ""  # the template's render of a probe exchange (its own markers, as text)
    # Tokens that may legitimately close a completion: the template's end-of-turn token and EOS.
    stop_ids: frozenset[int] = frozenset()
    whitespace_ids: frozenset[int] | WhitespaceIds = field(default_factory=frozenset)  # supports `in` only
    generation_prompt: str = ""
    # The probe's tokens after the user message: as the inference prompt has them (rendered with the
    # generation prompt) and as a training sequence has them (rendered with the answer). They differ when
    # the template renders the generation prompt differently from a completed turn.
    inference_tail: tuple[int, ...] = ()
    training_tail: tuple[int, ...] = ()

    @property
    def locatable(self) -> bool:
        return bool(self.assistant_header)

    def locate(self, ids: Sequence[int]) -> list[Span]:
        """Assistant turns in ``ids``: after each assistant header, up to and including the end of turn."""
        header, eot = self.assistant_header, self.end_of_turn
        if not header:
            return []
        spans: list[Span] = []
        n = len(ids)
        i = 0
        while (i := find_sequence(ids, header, i, n)) >= 0:
            lead = i + len(header) - self.header_own
            start = i + len(header)
            while start < n and ids[start] in self.whitespace_ids:
                start += 1
            stop = find_sequence(ids, eot, start, n) if eot else -1
            stop = n if stop < 0 else stop + len(eot)
            end = stop
            while end < n and (ids[end] in self.whitespace_ids or ids[end] in self.stop_ids):
                end += 1
            spans.append(Span(lead, start, stop, end))
            i = max(stop, start)
        return spans


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items ``a`` and ``b`` share (strings or id lists)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def find_sequence(ids: Sequence[int], needle: tuple[int, ...], start: int, stop: int) -> int:
    """First index >= start where ``needle`` occurs entirely before ``stop``, or -1 (``list.index`` does
    the scanning in C)."""
    m = len(needle)
    first = needle[0]
    ids = ids if isinstance(ids, list) else list(ids)
    while True:
        try:
            i = ids.index(first, start, stop)
        except ValueError:
            return -1
        if i + m > stop:
            return -1
        if m == 1 or tuple(ids[i : i + m]) == needle:
            return i
        start = i + 1


def _blank(tokenizer, token, idx: int) -> bool:
    # Filter on the raw piece first (byte-level and sentencepiece spellings): decoding 150k ids is slow.
    raw_blank = token and (token.strip(_RAW_WHITESPACE) == "" or token in _BYTE_WHITESPACE)
    return bool(raw_blank) and tokenizer.decode([idx]).strip() == ""


class WhitespaceIds:
    """The ids that decode to whitespace only (``\\n``, ``\\n\\n``, ``▁``: template glue between turns), as a
    set that decides each id the first time it is asked about (and remembers): listing a 150k vocabulary costs
    a tenth of a second per tokenizer, while turns are located by looking at a few hundred distinct ids.
    Supports ``in`` only."""

    def __init__(self, tokenizer) -> None:
        # Held weakly where it can be: markers kept for a tokenizer (derive_markers) must not keep it alive.
        try:
            self._tokenizer = weakref.ref(tokenizer)
        except TypeError:
            self._tokenizer = lambda: tokenizer
        self._known: dict[int, bool] = {}

    def __contains__(self, idx) -> bool:
        try:
            return self._known[idx]
        except KeyError:
            pass
        except TypeError:  # unhashable: no token id
            return False
        tokenizer = self._tokenizer()
        if tokenizer is None:  # gone: nothing more can be asked of its vocabulary
            return False
        try:
            token = tokenizer.convert_ids_to_tokens(int(idx))
            blank = isinstance(token, str) and _blank(tokenizer, token, int(idx))
        except (TypeError, ValueError, IndexError, OverflowError):  # not an id of this vocabulary
            blank = False
        self._known[idx] = blank
        return blank


_RAW_WHITESPACE = "ĠĊĉč▁ \n\t\r"
_BYTE_WHITESPACE = {"<0x0A>", "<0x20>", "<0x09>", "<0x0D>"}


def boundary_ids(tokenizer) -> frozenset[int]:
    """Special and added tokens: the template's structural pieces."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(set(tokenizer.all_special_ids) | set(added))


def derive_markers(tokenizer) -> TemplateMarkers:
    """Derive the markers by rendering a probe conversation with the tokenizer's template: once per tokenizer
    while what they are derived from is unchanged (its template, EOS, special tokens and vocabulary size).
    preflight, its rules and the callback ask for them again and again; three renders and two encodings cost
    0.3-0.8 ms a time, more on the cold caches of a training step."""
    try:
        made_from = _derived_from(tokenizer)
        kept = _DERIVED.get(tokenizer)
    except Exception:  # not hashable, not weakly referenceable, or a tokenizer that cannot say: derived anew
        return _derive(tokenizer)
    if kept is not None and kept[0] == made_from:
        return kept[1]
    markers = _derive(tokenizer)
    _DERIVED[tokenizer] = (made_from, markers)  # (the lookup above showed it can be a key)
    return markers


_DERIVED: weakref.WeakKeyDictionary[Any, tuple[tuple, TemplateMarkers]] = weakref.WeakKeyDictionary()


def _derived_from(tokenizer) -> tuple:
    """What :func:`_derive` reads of a tokenizer beside its (fixed) encoding: a changed one is derived again."""
    return (
        getattr(tokenizer, "chat_template", None),
        tokenizer.eos_token_id,
        len(tokenizer),
        tuple(tokenizer.all_special_ids),
    )


def _derive(tokenizer) -> TemplateMarkers:
    stop_ids = {tokenizer.eos_token_id} - {None}
    whitespace = WhitespaceIds(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        return TemplateMarkers(False, stop_ids=frozenset(stop_ids), whitespace_ids=whitespace)
    user = [{"role": "user", "content": PROBE_USER}]
    both = [*user, {"role": "assistant", "content": PROBE_ASSISTANT}]
    try:
        with_prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(user, tokenize=False)
        full = tokenizer.apply_chat_template(both, tokenize=False)
    except Exception:  # a template that rejects the probe: turns cannot be located
        return TemplateMarkers(True, stop_ids=frozenset(stop_ids), whitespace_ids=whitespace)
    generation_prompt = with_prompt[len(without) :] if with_prompt.startswith(without) else ""
    u_end = full.find(PROBE_USER) + len(PROBE_USER)
    a_start = full.find(PROBE_ASSISTANT, u_end)
    if a_start < 0:
        return TemplateMarkers(True, stop_ids=frozenset(stop_ids), whitespace_ids=whitespace)
    a_end = a_start + len(PROBE_ASSISTANT)
    # The header ends where the model starts generating: at the end of the generation prompt when a completed
    # turn starts with it (whatever the template adds after it is the model's to write), else at the answer.
    header_end = len(with_prompt) if full.startswith(with_prompt) and len(with_prompt) <= a_start else a_start
    user_end = len(without) if full.startswith(without) else u_end  # where the user's turn is closed
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    header = [(i, s) for i, (s, e) in zip(ids, offsets) if s >= u_end and e <= header_end and e > s]
    tail = [i for i, (s, e) in zip(ids, offsets) if s >= a_end and e > s]
    # Trim template whitespace at both ends of the header and keep the end of turn up to its first
    # non-whitespace run (``<|im_end|>`` of ``<|im_end|>\n``).
    while header and header[0][0] in whitespace:
        header.pop(0)
    while header and header[-1][0] in whitespace:  # re-found by skipping whitespace after the header
        header.pop()
    header_own = sum(1 for _, s in header if s >= user_end)
    while tail and tail[0] in whitespace:
        tail.pop(0)
    eot: list[int] = []
    boundaries = boundary_ids(tokenizer)
    for idx in tail:
        if idx in whitespace:
            break
        eot.append(idx)
        if idx in boundaries:
            break
    stop_ids |= {eot[-1]} if eot else set()
    prompted = tokenizer(with_prompt, add_special_tokens=False, return_offsets_mapping=True)
    prompt_ids = prompted["input_ids"]
    generation_ids = tuple(
        i for i, (s, e) in zip(prompt_ids, prompted["offset_mapping"]) if s >= user_end and e > s
    )
    shared = 0
    while shared < min(len(prompt_ids), len(ids)) and prompt_ids[shared] == ids[shared]:
        shared += 1
    user_end_token = next((k for k, (s, e) in enumerate(offsets) if e >= u_end), len(ids))
    start = min(shared, user_end_token + 1)
    # Turn markers: the special tokens the template renders around the probe's contents, not inside the
    # answer's side (a reasoning block there is content the model writes).
    markers = {i for i, (s, _) in zip(ids, offsets) if i in boundaries and not header_end <= s < a_end}
    return TemplateMarkers(
        True,
        assistant_header=tuple(i for i, _ in header),
        header_own=header_own,
        end_of_turn=tuple(eot),
        generation_ids=generation_ids,
        probe_render=full,
        turn_marker_ids=frozenset(markers),
        stop_ids=frozenset(stop_ids),
        whitespace_ids=whitespace,
        generation_prompt=generation_prompt,
        inference_tail=tuple(prompt_ids[start:]),
        training_tail=tuple(ids[start : start + len(prompt_ids) - start]),
    )
