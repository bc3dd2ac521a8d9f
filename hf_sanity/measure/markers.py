"""Where turns begin and end, derived from the tokenizer's own chat template (no family is hard-coded).

Rendering a probe conversation tells us, in token ids as they appear in context:

* the *assistant header*: what the template puts between the end of a user message and the start of
  the assistant's answer (``<|im_end|>\\n<|im_start|>assistant\\n`` for ChatML, `` [/INST]`` for Mistral);
* the *end of turn*: the first tokens after an assistant answer (``<|im_end|>``, ``<|eot_id|>``, ``</s>``).

With these, assistant turns can be located in any token sequence: pre-tokenized datasets, text datasets that
carry the template's markers, and the collated batches of a real Trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PROBE_USER = "Probe question zq"
PROBE_ASSISTANT = "Probe answer zq"


@dataclass(frozen=True)
class Span:
    """One completion in token positions: ``[start, stop)`` carries the answer and its end-of-turn token;
    ``[stop, end)`` is template whitespace after it, neither prompt nor completion."""

    start: int
    stop: int
    end: int


@dataclass(frozen=True)
class TemplateMarkers:
    has_template: bool
    assistant_header: tuple[int, ...] = ()
    end_of_turn: tuple[int, ...] = ()
    # Tokens that may legitimately close a completion: the template's end-of-turn token and EOS.
    stop_ids: frozenset[int] = frozenset()
    whitespace_ids: frozenset[int] = field(default_factory=frozenset)
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
            start = i + len(header)
            while start < n and ids[start] in self.whitespace_ids:
                start += 1
            stop = find_sequence(ids, eot, start, n) if eot else -1
            stop = n if stop < 0 else stop + len(eot)
            end = stop
            while end < n and (ids[end] in self.whitespace_ids or ids[end] in self.stop_ids):
                end += 1
            spans.append(Span(start, stop, end))
            i = max(stop, start)
        return spans


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


def whitespace_token_ids(tokenizer) -> frozenset[int]:
    """Ids that decode to whitespace only (``\\n``, ``\\n\\n``, ``▁``): template glue between turns."""
    out = set()
    for token, idx in tokenizer.get_vocab().items():
        # Filter on the raw piece first (byte-level and sentencepiece spellings): decoding 150k ids is slow.
        raw_blank = token and (token.strip(_RAW_WHITESPACE) == "" or token in _BYTE_WHITESPACE)
        if raw_blank and tokenizer.decode([idx]).strip() == "":
            out.add(idx)
    return frozenset(out)


_RAW_WHITESPACE = "ĠĊĉč▁ \n\t\r"
_BYTE_WHITESPACE = {"<0x0A>", "<0x20>", "<0x09>", "<0x0D>"}


def boundary_ids(tokenizer) -> frozenset[int]:
    """Special and added tokens: the template's structural pieces."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(set(tokenizer.all_special_ids) | set(added))


def derive_markers(tokenizer) -> TemplateMarkers:
    """Derive the markers by rendering a probe conversation with the tokenizer's template."""
    stop_ids = {tokenizer.eos_token_id} - {None}
    whitespace = whitespace_token_ids(tokenizer)
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
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    header = [i for i, (s, e) in zip(ids, offsets) if s >= u_end and e <= a_start and e > s]
    tail = [i for i, (s, e) in zip(ids, offsets) if s >= a_end and e > s]
    # Trim template whitespace at both ends of the header and keep the end of turn up to its first
    # non-whitespace run (``<|im_end|>`` of ``<|im_end|>\n``).
    while header and header[0] in whitespace:
        header.pop(0)
    while header and header[-1] in whitespace:  # re-found by skipping whitespace after the header
        header.pop()
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
    prompt_ids = tokenizer(with_prompt, add_special_tokens=False)["input_ids"]
    shared = 0
    while shared < min(len(prompt_ids), len(ids)) and prompt_ids[shared] == ids[shared]:
        shared += 1
    user_end_token = next((k for k, (s, e) in enumerate(offsets) if e >= u_end), len(ids))
    start = min(shared, user_end_token + 1)
    return TemplateMarkers(
        True,
        assistant_header=tuple(header),
        end_of_turn=tuple(eot),
        stop_ids=frozenset(stop_ids),
        whitespace_ids=whitespace,
        generation_prompt=generation_prompt,
        inference_tail=tuple(prompt_ids[start:]),
        training_tail=tuple(ids[start : start + len(prompt_ids) - start]),
    )
