"""Turn dataset rows into training tokens, the way TRL's SFTTrainer does, and measure them in the same pass.

One pass per row produces the token ids, the labels, where each completion lies, and every count the rules
read (supervised tokens, prompt tokens in the loss, completion tokens cut by ``max_len``, ...). Rules then
work on these columns with arithmetic; nothing tokenizes the dataset again.
"""

from __future__ import annotations

import gc
import hashlib
import re
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hf_sanity.constants import IGNORE_INDEX
from hf_sanity.measure import loss_mask
from hf_sanity.measure.families import FAMILY_OF, NO_TEMPLATE
from hf_sanity.measure.formats import USER_TEXTS, Layout, conversation_problem, text_problem
from hf_sanity.measure.markers import (
    Span,
    TemplateMarkers,
    boundary_ids,
    common_prefix,
    derive_markers,
    find_sequence,
)


def content_markers(tokenizer, markers: TemplateMarkers) -> set[str]:
    """Special tokens that belong inside message content: the chat template mentions them but does not use
    them as turn or role boundaries (reasoning ``<think>``/``</think>``, tool-call tags). Data carrying them is
    what the template is built around, not stray markers."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or not template:
        return set()
    added = {str(t): i for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    return {t for t, i in added.items() if t in template and i not in markers.turn_marker_ids}


def dropped_content(messages: list[dict[str, Any]], first: int, full: str) -> dict[str, Any]:
    """What of the messages the rendered conversation does not carry, in characters: a template that strips
    reasoning (DeepSeek-R1 keeps only what follows ``</think>``) or drops tool calls trains on less than the
    data holds. Lines are compared stripped (templates trim whitespace), so only content that is gone counts."""
    out = {
        "n_dropped_supervised": 0, "n_supervised_chars": 0, "n_dropped_other": 0, "n_dropped_system": 0,
        "dropped_text": "",
    }  # fmt: skip
    for j, message in enumerate(messages):
        supervised = message.get("role") == "assistant" and j >= first
        pieces = [message["content"]] if isinstance(message.get("content"), str) else []
        for call in message.get("tool_calls") or []:  # a call is gone when its function name is (templates
            function = (
                call.get("function", call) if isinstance(call, dict) else {}
            )  # format arguments freely)
            pieces += [str(function.get("name", ""))]
        for piece in pieces:
            if supervised:
                out["n_supervised_chars"] += len(piece)
            if not piece or piece in full:
                continue
            gone = [line for line in piece.splitlines() if line.strip() and not _rendered(line.strip(), full)]
            lost = sum(len(line) for line in gone)
            if not lost:
                continue
            out["n_dropped_supervised" if supervised else "n_dropped_other"] += lost
            out["n_dropped_system"] += lost if message.get("role") == "system" else 0
            out["dropped_text"] = out["dropped_text"] or "\n".join(gone)[:200]
    return out


def system_merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation with its system turns merged into the first user turn (``system\\n\\nuser``), as
    templates without a system role expect it; None without a system turn or a user turn after it."""
    system = [m for m in messages if isinstance(m, dict) and m.get("role") == "system"]
    if not system or not all(isinstance(m.get("content"), str) for m in system):
        return None
    rest = [m for m in messages if not (isinstance(m, dict) and m.get("role") == "system")]
    first_user = next(
        (i for i, m in enumerate(rest) if isinstance(m, dict) and m.get("role") == "user"), None
    )
    if first_user is None or not isinstance(rest[first_user].get("content"), str):
        return None
    prefix = "\n\n".join(m["content"] for m in system)
    rest[first_user] = {**rest[first_user], "content": f"{prefix}\n\n{rest[first_user]['content']}"}
    return rest


def _rendered(text: str, full: str) -> bool:
    """``text`` is in the render as it is, or JSON-escaped (templates that ``tojson`` a tool result)."""
    import json

    return text in full or json.dumps(text)[1:-1] in full


def template_kwargs(row: dict[str, Any]) -> dict[str, Any] | str:
    """What TRL passes the chat template besides the messages: the row's ``tools`` (a list of function
    schemas, or its JSON string) and its ``chat_template_kwargs`` (e.g. ``documents``, ``enable_thinking``);
    a problem with them, as a string."""
    import json

    kwargs: dict[str, Any] = {}
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            return f"tools is not valid JSON ({exc.msg})"
    if tools:  # `or None`, as TRL: some templates render tool boilerplate for tools=[]
        kwargs["tools"] = tools
    extra = row.get("chat_template_kwargs")
    if extra:
        if not isinstance(extra, dict):
            return f"chat_template_kwargs is {type(extra).__name__}, not a mapping"
        kwargs.update(extra)
    return kwargs


def text_of(message: dict[str, Any]) -> str:
    """A message's text for the data checks (duplicates, leakage, stray markers): its content, and the
    function calls an assistant turn makes."""
    import json

    content = message.get("content")
    text = content if isinstance(content, str) else ""
    calls = message.get("tool_calls") or []
    if calls:
        text = " ".join([text, *(json.dumps(call, sort_keys=True, default=str) for call in calls)]).strip()
    return text


def stable_hash(text: str) -> int:
    """A 63-bit hash stable across processes (unlike `hash`), for duplicate and leakage detection."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


@dataclass
class EncodeOptions:
    fmt: str  # as detected (formats.FORMATS); ShareGPT and Alpaca rows are converted to what TRL reads
    # "completion", "assistant" (the same labels, as `assistant_only_loss=True` takes them from the chat template's
    # {% generation %} markers: generation-markers-missing checks the template gives them) or "all"; None: what
    # TRL's SFTTrainer does with the format (`measure.loss_mask`: every token of messages and text rows, the
    # completion of prompt-completion rows).
    loss_on: str | None = None
    max_len: int | None = None
    min_leak_chars: int = 20
    alpaca_template: str | None = None  # "chat" or "text"; default: chat when the tokenizer has a template
    # The rows arrive already cut at this length (a trainer's max_length, keeping the start): a row this long
    # whose last completion has no end-of-turn lost its end to truncation, not to a masking bug.
    arrived_cut_at: int | None = None
    # Where that length was read: the trainer's "arguments", a framework's "config", or off the first "batch".
    arrived_cut_source: str | None = None
    # The rows are pieces of a packed stream of examples, cut every this many tokens (TRL's "wrapped" or
    # "bfd_split" packing): a row may start inside an answer begun in the row before, and a row this long may
    # end inside one that the next row continues. Neither is a missing end of turn, a prompt in the loss or a
    # truncation.
    packed_cut_at: int | None = None


# Every column the encoder writes, with its empty value (for rows that cannot be encoded).
MEASURES: dict[str, Any] = {
    "input_ids": [],
    "labels": [],
    "spans": [],  # flat [lead, start, stop, end, ...] per completion (see markers.Span)
    "error": "",
    "n_tokens": 0,
    "n_supervised": 0,
    "n_supervised_kept": 0,
    "n_turns": 0,
    "n_completion": 0,
    "n_completion_unsupervised": 0,
    "n_completion_cut": 0,
    "arrived_cut": False,  # the row came cut at arrived_cut_at, inside a completion (how much is unknown)
    # ... or before a later turn's answer: the cut left a turn after the last complete answer, and none of its
    # answer's tokens (multi-turn rows TRL keeps, since earlier answers still carry loss).
    "arrived_turn_lost": False,
    "arrived_prompt_cut": False,  # the row came cut at arrived_cut_at with no turn left to locate: its prompt cut
    # The row is a piece of a longer example cut by the packing (see ``EncodeOptions.packed_cut_at``): it
    # starts inside one or runs to the cut. Example-level rules (duplicates, an example without loss) skip it.
    "piece": False,
    "n_prompt_supervised": -1,  # -1: turns could not be located
    "n_eot_missing": 0,
    "n_eot_unsupervised": 0,
    "n_leading_bos": 0,
    "n_label_eq_next": 0,
    "n_label_eq_same": 0,
    "n_gp_mismatch": 0,  # assistant turns whose training text does not start with the inference prompt
    "n_gp_merge": 0,  # ... whose text does, but whose tokens merge across the boundary
    "content_markers": [],
    "text_families": [],
    "hash": 0,
    # An answer (20+ characters, normalized) found verbatim in the text before it: its length over that text's
    # (0.0: none found), and how many characters of that text follow it (-1: none found).
    "leak": 0.0,
    "leak_after": -1,
    # Trained answers that open with the prompt (the user turn just before them) verbatim, 20+ characters: a
    # completion built as prompt + answer.
    "n_echo": 0,
    "max_id": -1,
    "special_ids": [],  # special/added token ids the example uses
    "n_dropped_supervised": 0,  # characters of trained messages the chat template does not render
    "n_supervised_chars": 0,
    "n_dropped_other": 0,  # ... of the other messages
    "n_dropped_system": 0,  # ... of them, of system messages
    # The chat template rejected the row, and renders it once its system turn is merged into the first user
    # turn: the template has no system role (Mistral's raises on one).
    "system_refused": False,
    "dropped_text": "",  # the first text the template dropped
}


def end_before_whitespace(ids, start: int, last: int, stop_ids, whitespace_ids) -> int | None:
    """Where a span that ends in whitespace tokens closes: the stop token just before them (LLaMA-Factory's
    templates train ``<|im_end|>\n``), or None when no stop token precedes the whitespace."""
    at = last
    while at > start and ids[at] in whitespace_ids:
        at -= 1
    return at if at < last and ids[at] in stop_ids else None


class Encoder:
    """``datasets.map(Encoder(...), batched=True)``: rows in, tokens and measurements out.

    Picklable, so ``num_proc`` works.
    """

    def __init__(self, tokenizer, options: EncodeOptions, markers: TemplateMarkers | None = None):
        self.tokenizer = tokenizer
        self.options = options
        self.markers = markers or derive_markers(tokenizer)
        self.layout = Layout.of(
            options.fmt, has_template=self.markers.has_template, alpaca_template=options.alpaca_template
        )
        self.fmt = self.layout.read_as  # what the rows are, once converted
        self.loss_mask = loss_mask.of_format(self.fmt, options.loss_on)
        self._masked = self.loss_mask.mode != "all"  # labels on the located completions only
        specials = {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        specials |= {str(t) for t in tokenizer.all_special_tokens}
        strays = sorted(
            (specials - content_markers(tokenizer, self.markers)) | set(FAMILY_OF), key=len, reverse=True
        )
        self._stray_re = re.compile("|".join(re.escape(s) for s in strays if s.strip())) if strays else None
        self._family_re = re.compile("|".join(re.escape(m) for m in FAMILY_OF))
        self._boundaries = boundary_ids(tokenizer)

    # -- public ------------------------------------------------------------------------------------
    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        # A batch allocates hundreds of thousands of small lists and dicts that all live until it is written,
        # and nothing of it forms a cycle: the cyclic collector would walk them again and again (a third of
        # the per-row overhead over a bare tokenization pass). It runs once after the batch instead.
        collecting = gc.isenabled()
        gc.disable()
        try:
            size = len(next(iter(batch.values())))
            encoded = self.encode_rows(
                [{key: values[i] for key, values in batch.items()} for i in range(size)]
            )
            return {key: [e[key] for e in encoded] for key in MEASURES}
        finally:
            if collecting:
                gc.enable()

    def encode(self, row: dict[str, Any]) -> dict[str, Any]:
        return self.encode_rows([row])[0]

    def encode_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rows as given (any format of ``formats.FORMATS``) in, one encoded row each out."""
        converted = [self.layout.to_trl(row) for row in rows]
        out: list[dict[str, Any]] = [self.failed(r) if isinstance(r, str) else {} for r in converted]
        readable = [k for k, r in enumerate(converted) if isinstance(r, dict)]
        if self.fmt in ("messages", "prompt-completion"):
            for k, encoded in zip(readable, self.encode_conversations([converted[k] for k in readable])):
                out[k] = encoded
            return out
        for k in readable:
            row = converted[k]
            try:
                if self.fmt == "text":
                    out[k] = self.encode_text(row.get("text"))
                else:
                    out[k] = self.encode_tokens(
                        row.get("input_ids"), row.get("labels"), row.get("attention_mask")
                    )
            except Exception as exc:  # the tokenizer rejected this row: a data problem
                out[k] = self.failed(f"{type(exc).__name__}: {exc}")
        return out

    # -- conversations -----------------------------------------------------------------------------
    # Where each completion starts comes from the chat template: the conversation up to that turn, rendered
    # with the generation prompt (the inference prompt), must be a prefix of the training text ("exact").
    # Rendering every prefix of every row costs more than the tokenization itself, so `calibrate` runs the
    # exact method on the first rows and, where the template's own markers (derived from it once) find the
    # very same spans, the full pass locates turns by those markers ("markers"). A row whose markers do not
    # match its assistant turns is still encoded exactly.
    exact: bool = True
    # The marker method needs no character offsets: the backend's `encode_batch_fast` skips them (~30% of the
    # tokenization), used once calibration shows it gives the ids the tokenizer's own call gives.
    fast_ids: bool = False

    def calibrate(self, rows: list[dict[str, Any]]) -> None:
        """Choose the marker method when it agrees with the exact one on every one of ``rows``."""
        self.exact, self.fast_ids = True, False
        if not self.markers.locatable:
            return
        agree = 0
        texts, ids = [], []
        for row in rows:
            row = self.layout.to_trl(row)
            conversation = self._conversation(row) if isinstance(row, dict) else None
            if not isinstance(conversation, tuple):
                continue
            messages, first, kwargs = conversation
            try:
                full = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
                enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
                exact, gp = self._exact_spans(
                    messages, first, full, enc["input_ids"], enc["offset_mapping"], kwargs
                )
            except Exception:
                continue
            if any(gp) or self._marker_spans(messages, first, enc["input_ids"]) != exact:
                return
            agree += 1
            texts.append(full)
            ids.append(list(enc["input_ids"]))
        self.exact = agree == 0
        self.fast_ids = not self.exact and offsetless_ids(self.tokenizer, texts) == ids

    def _conversation(self, row: dict[str, Any]):
        """(messages, index of the first supervised message, template kwargs), a failure dict, or None for
        plain-text prompt/completion rows. The messages are passed to the template as they are (tool calls,
        names, reasoning fields included) with the row's ``tools`` and ``chat_template_kwargs``, as TRL does."""
        if self.fmt == "messages":
            messages, first = row.get("messages"), 0
        else:
            prompt, completion = row.get("prompt"), row.get("completion")
            if not isinstance(prompt, list) and not isinstance(completion, list):
                return None
            if not isinstance(prompt, list) or not isinstance(completion, list) or not completion:
                return self.failed("prompt and completion must both be message lists (conversational format)")
            messages, first = list(prompt) + list(completion), len(prompt)
        if not self.markers.has_template:
            return self.failed(NO_TEMPLATE)
        problem = conversation_problem(messages)
        if problem:
            return self.failed(problem)
        kwargs = template_kwargs(row)
        if isinstance(kwargs, str):
            return self.failed(kwargs)
        return list(messages), first, kwargs

    def encode_conversations(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Render each conversation with the chat template, tokenize the batch in one call, measure each."""
        out: list[dict[str, Any] | None] = [None] * len(rows)
        pending: list[tuple[int, list[dict], int, dict, str]] = []
        for k, row in enumerate(rows):
            conversation = None
            try:
                conversation = self._conversation(row)
                if conversation is None:
                    out[k] = self.encode_prompt_completion(
                        row.get("prompt"), row.get("completion"), user_texts=row.get(USER_TEXTS)
                    )
                elif isinstance(conversation, dict):
                    out[k] = conversation
                else:
                    messages, first, kwargs = conversation
                    full = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
                    pending.append((k, messages, first, kwargs, full))
            except Exception as exc:  # the template rejected this row: a data problem
                out[k] = self.failed(f"{type(exc).__name__}: {exc}")
                out[k]["system_refused"] = self._refuses_system(conversation)
        if pending:
            texts = [text for *_, text in pending]
            ids = offsetless_ids(self.tokenizer, texts) if self.fast_ids else None
            offsets = None  # character offsets, for the exact method only
            if ids is None:
                enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=self.exact)
                ids, offsets = enc["input_ids"], enc["offset_mapping"] if self.exact else None
            for n, (k, messages, first, kwargs, full) in enumerate(pending):
                at = offsets[n] if offsets is not None else None
                try:
                    out[k] = self._measure_conversation(messages, first, full, ids[n], at, kwargs)
                except Exception as exc:
                    out[k] = self.failed(f"{type(exc).__name__}: {exc}")
        return out

    def _measure_conversation(self, messages, first, full, ids, offsets, kwargs) -> dict[str, Any]:
        gp_mismatch = (0, 0)
        spans = None if offsets is not None else self._marker_spans(messages, first, ids)
        if spans is None:  # exact method (chosen by calibration, or markers did not fit this row)
            if offsets is None:
                offsets = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)[
                    "offset_mapping"
                ]
            spans, gp_mismatch = self._exact_spans(messages, first, full, ids, offsets, kwargs)
        if first and spans and self.loss_mask.mode == "completion":
            # TRL's completion_mask: every token after the prompt, the template's whitespace after the end of
            # the turn included (`labels` marks the answers' own tokens only)
            labels = [IGNORE_INDEX] * spans[0].start + list(ids[spans[0].start :])
        else:
            labels = self._labels(ids, spans if self._masked else None)
        texts = [(m["role"], text_of(m)) for m in messages]
        # Each text is normalized once (its words): `normalize` of texts joined by spaces is their words joined.
        conversation: list[str] = []
        heard: list[str] = []  # the other speakers' words so far
        answers = []  # each trained answer against what the model reads before it
        echoes = []  # each trained answer against the last turn it answers
        prompt = ""
        for j, (role, text) in enumerate(texts):
            said = text.lower().split()
            conversation += f"{role}:".lower().split()
            conversation += said
            if role != "assistant":
                heard += said
                prompt = " ".join(said)
            elif j >= first:
                answers.append((" ".join(heard), " ".join(said)))
                echoes.append((prompt, " ".join(said)))
        out = self.measure(ids, labels, spans, user_labels=False)
        out.update(
            gp=gp_mismatch,
            content=self._strays(text for _, text in texts),
            hash=stable_hash(" ".join(conversation)),
            leak=self._leaks(answers, normalized=True),
            echo=self._echoes(echoes),
            **dropped_content(messages, first, full),
        )
        return self._finish(out)

    def _refuses_system(self, conversation) -> bool:
        """The template that rejected ``conversation`` renders it with its system turn merged into the first
        user turn."""
        if not isinstance(conversation, tuple):
            return False
        messages, _, kwargs = conversation
        merged = system_merged(messages)
        if merged is None:
            return False
        try:
            self.tokenizer.apply_chat_template(merged, tokenize=False, **kwargs)
        except Exception:
            return False
        return True

    def _exact_spans(
        self, messages, first, full, ids, offsets, kwargs=None
    ) -> tuple[list[Span], tuple[int, int]]:
        """The completions located exactly, and how many turns' inference prompt is not a prefix of the
        training text (differs) or is, but not on a token boundary (merges)."""
        tok = self.tokenizer
        kwargs = kwargs or {}
        starts = [s for s, _ in offsets]
        spans: list[Span] = []
        differs = merges = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < first:
                continue
            prompt = tok.apply_chat_template(
                messages[:i], tokenize=False, add_generation_prompt=True, **kwargs
            )
            before = tok.apply_chat_template(messages[:i], tokenize=False, **kwargs) if i else ""
            # The assistant turn's own scaffolding (its header) starts where the conversation before it ends.
            lead_char = len(before) if prompt.startswith(before) and full.startswith(before) else None
            if full.startswith(prompt):
                start_char = len(prompt)
            else:  # the inference prompt is not what training saw: fall back to the shared prefix
                differs += 1
                start_char = common_prefix(full, prompt)
            start = bisect_left(starts, start_char)
            straddles = (start < len(starts) and starts[start] != start_char) or (
                start > 0 and offsets[start - 1][1] > start_char
            )
            if straddles and full.startswith(prompt):
                merges += 1  # a token straddles the boundary: the prompt is not a token prefix
            if self.markers.end_of_turn:  # _close stops at the first end-of-turn marker
                end = len(ids)
            else:
                through = tok.apply_chat_template(messages[: i + 1], tokenize=False, **kwargs)
                end = bisect_left(starts, len(through) if full.startswith(through) else len(full))
            lead = min(bisect_left(starts, lead_char), start) if lead_char is not None else start
            spans.append(self._close(ids, start, end, lead=lead))
        return spans, (differs, merges)

    def _marker_spans(self, messages, first, ids) -> list[Span] | None:
        """The supervised turns located by the template's markers, or None if they do not fit this row."""
        located = self.markers.locate(ids)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(located) != len(turns):
            return None
        return [span for span, i in zip(located, turns) if i >= first]

    def encode_prompt_completion(self, prompt, completion, *, user_texts=None) -> dict[str, Any]:
        """Plain-text prompt/completion, as TRL does: the completion starts where prompt and
        prompt+completion tokenizations diverge; EOS appended. ``user_texts``: (prompt, completion) as the user
        wrote them, where a template (Alpaca's) wrote the prompt around them."""
        problem = text_problem(prompt, "prompt") or text_problem(completion, "completion")
        if problem:
            return self.failed(problem)
        tok = self.tokenizer
        eos = tok.eos_token or ""
        full_text = prompt + completion + ("" if completion.endswith(eos) else eos)  # TRL appends EOS
        prompt_ids = tok(prompt)["input_ids"]
        ids = tok(full_text)["input_ids"]
        start = common_prefix(prompt_ids, ids)
        spans = [self._close(ids, start, len(ids))]
        labels = self._labels(ids, spans if self._masked else None)
        out = self.measure(ids, labels, spans, user_labels=False)
        own_prompt, own_completion = user_texts or (prompt, completion)
        out.update(
            gp=(0, int(start < len(prompt_ids))),  # the text is a prefix: only tokens can merge
            content=self._strays([own_prompt, own_completion]),
            hash=stable_hash(normalize(prompt + " " + completion)),
            leak=self._leaks([(own_prompt, own_completion)]),
            echo=self._echoes([(normalize(own_prompt), normalize(own_completion))]),
        )
        return self._finish(out)

    def encode_text(self, text) -> dict[str, Any]:
        problem = text_problem(text, "text")
        if problem:
            return self.failed(problem)
        tok = self.tokenizer
        eos = tok.eos_token or ""
        ids = tok(text + ("" if text.endswith(eos) else eos))["input_ids"]  # TRL appends EOS
        spans = self.markers.locate(ids) if self.markers.locatable else []
        labels = self._labels(ids, None)  # language modelling: every token carries loss
        out = self.measure(ids, labels, spans or [self._whole(ids)], user_labels=False, located=bool(spans))
        out.update(
            families=sorted({FAMILY_OF[m] for m in self._family_re.findall(text)}),
            hash=stable_hash(normalize(text)),
            gp=self._missing_extras(ids, spans),
        )
        return self._finish(out)

    def encode_tokens(self, input_ids, labels=None, attention_mask=None) -> dict[str, Any]:
        if not input_ids:
            return self.failed("input_ids is empty")
        ids = [int(i) for i in input_ids]
        if attention_mask is not None:  # padding (left or right) is not part of the example
            keep = [i for i, m in enumerate(attention_mask) if int(m)]
            if len(keep) < len(ids):
                ids = [ids[i] for i in keep]
                labels = None if labels is None else [labels[i] for i in keep]
        user_labels = labels is not None
        labels = [int(x) for x in labels] if user_labels else list(ids)
        if len(labels) != len(ids):
            return self.failed(f"labels has {len(labels)} entries for {len(ids)} input_ids")
        turns = self.markers.locate(ids) if self.markers.locatable else []
        packed_at = self.options.packed_cut_at
        spans = (self._continued(ids, labels) if packed_at else []) + turns
        out = self.measure(
            ids, labels, spans or [self._whole(ids)], user_labels=user_labels, located=bool(spans)
        )
        out["piece"] = bool(packed_at) and (len(ids) >= packed_at or not self._opens_turn(ids))
        out["hash"] = stable_hash(" ".join(map(str, ids)))
        out["gp"] = self._missing_extras(ids, turns)
        return self._finish(out)

    def _continued(self, ids: Sequence[int], labels: Sequence[int]) -> list[Span]:
        """The end of an answer a packed row starts with (begun in the row before it), as a completion: the
        tokens up to the first end of turn, when that comes before any assistant header and the row does not
        open with a turn of its own (BOS, a turn-start marker); it starts at its first supervised token (what
        comes before is the rest of its header, cut by the packing). [] otherwise."""
        eot, header = self.markers.end_of_turn, self.markers.assistant_header
        if not eot or not header or self._opens_turn(ids):
            return []
        stop = find_sequence(ids, eot, 0, len(ids))
        at_header = find_sequence(ids, header, 0, len(ids))
        if stop < 0 or (0 <= at_header <= stop):
            return []  # no end of turn, or it closes a user turn (the header starts with it)
        start = next((i for i in range(stop) if labels[i] != IGNORE_INDEX), 0)
        return [self._close(ids, start, len(ids), lead=0)]

    def _opens_turn(self, ids: Sequence[int]) -> bool:
        """The row starts where an example or a turn starts: with BOS or a turn-start marker."""
        first = ids[0] if len(ids) else None
        return first == self.tokenizer.bos_token_id or (
            first in self.markers.turn_marker_ids and first not in self.markers.stop_ids
        )

    def _missing_extras(self, ids: Sequence[int], spans: list[Span]) -> tuple[int, int]:
        """Located turns of a pre-rendered sequence that do not start with the generation prompt's tokens
        (DeepSeek-R1's ``<think>\\n`` after its header): inference prompts the model into a state these turns
        never had. (differs, merges) as in ``_exact_spans``."""
        prompt = self.markers.generation_ids
        differs = merges = 0
        if not prompt:
            return 0, 0
        served = None
        for span in spans:
            if tuple(ids[span.lead : span.lead + len(prompt)]) == prompt:
                continue
            if span.lead + len(prompt) > len(ids):  # the row ends inside the turn's start: nothing to compare
                continue
            served = self.tokenizer.decode(list(prompt)) if served is None else served
            if self.tokenizer.decode(list(ids[span.lead : span.lead + len(prompt) + 2])).startswith(served):
                merges += 1
            else:
                differs += 1
        return differs, merges

    # -- pieces ------------------------------------------------------------------------------------
    def _close(self, ids: Sequence[int], start: int, limit: int, *, lead: int | None = None) -> Span:
        """The completion starting at ``start`` (rendered no further than ``limit``): up to and including its
        end-of-turn marker; the template whitespace or trailing EOS after it is neutral (see ``Span``), and so
        is the turn's own scaffolding from ``lead``."""
        lead = start if lead is None else lead
        eot = self.markers.end_of_turn
        found = find_sequence(ids, eot, start, limit) if eot else -1
        if found >= 0:
            stop = end = found + len(eot)
            while end < limit and (
                ids[end] in self.markers.whitespace_ids or ids[end] in self.markers.stop_ids
            ):
                end += 1
            return Span(lead, start, stop, end)
        stop = limit
        while stop > start and ids[stop - 1] in self.markers.whitespace_ids:
            stop -= 1
        return Span(lead, start, stop, limit)

    def _whole(self, ids: Sequence[int]) -> Span:
        """A sequence without located turns is one completion (language modelling), after any BOS."""
        start = 0
        bos = self.tokenizer.bos_token_id
        while start < len(ids) - 1 and bos is not None and ids[start] == bos:
            start += 1
        return Span(start, start, len(ids), len(ids))

    def _labels(self, ids: Sequence[int], spans: list[Span] | None) -> list[int]:
        if spans is None:
            return list(ids)
        labels = [IGNORE_INDEX] * len(ids)
        for span in spans:
            labels[span.start : span.stop] = ids[span.start : span.stop]
        return labels

    def _strays(self, texts) -> list[str]:
        if self._stray_re is None:
            return []
        found: set[str] = set()
        for text in texts:
            found.update(self._stray_re.findall(text))
        return sorted(found)

    def _echoes(self, pairs: list[tuple[str, str]]) -> int:
        """How many (prompt, answer) pairs, both normalized, have the answer open with the whole prompt."""
        return sum(
            1
            for prompt, answer in pairs
            if len(prompt) >= self.options.min_leak_chars and answer.startswith(prompt)
        )

    def _leaks(self, answers: list[tuple[str, str]], *, normalized: bool = False) -> tuple[float, int]:
        """For (text before, answer) pairs: the largest answer/text length ratio among the answers found
        verbatim in their text before, and the fewest characters of that text after one (see ``MEASURES``).
        label-leakage tells a quoted span of a long context from an answer pasted into the prompt by them.
        ``normalized``: both texts of each pair are already ``normalize``d."""
        ratio, after = 0.0, -1
        for before, answer in answers:
            answer = answer if normalized else normalize(answer)
            if len(answer) < self.options.min_leak_chars:
                continue
            before = before if normalized else normalize(before)
            at = before.rfind(answer)
            if at < 0:
                continue
            tail = len(before) - at - len(answer)
            ratio = max(ratio, len(answer) / len(before))
            after = tail if after < 0 else min(after, tail)
        return ratio, after

    def measure(
        self, ids: list[int], labels: list[int], spans: list[Span], *, user_labels: bool, located: bool = True
    ) -> dict[str, Any]:
        """Every count the rules read, from slices (no per-token Python work where a slice will do)."""
        n = len(ids)
        kept = min(n, self.options.max_len or n)
        ignore = IGNORE_INDEX
        n_supervised = n - labels.count(ignore)
        n_completion = n_completion_unsup = n_completion_cut = sup_in_turns = 0
        eot_missing = eot_unsup = 0
        stop_ids = self.markers.stop_ids
        trained_any = False
        untrained_width = 0
        cut_at = self.options.arrived_cut_at
        packed_at = self.options.packed_cut_at
        arrived_cut = False
        for span in spans:
            width = span.stop - span.start
            last = span.stop - 1
            ends = width > 0 and ids[last] in stop_ids
            if not ends and width > 1:  # template glue trained after the end of turn (`<|im_end|>\n`)
                closing = end_before_whitespace(ids, span.start, last, stop_ids, self.markers.whitespace_ids)
                if closing is not None:
                    ends, last = True, closing
            if not ends and cut_at and n >= cut_at and span.end == n:
                arrived_cut = True  # its end-of-turn was past the cut: truncated-completion's, not missing
                ends = None
            elif not ends and packed_at and (n >= packed_at or not located) and span.end == n:
                ends = None  # the packing cut it here (the next row goes on with it), or a piece of text
            content_stop = last if ends else span.stop
            masked = labels[span.start : content_stop].count(ignore)
            n_completion += width
            n_completion_cut += max(0, span.stop - max(kept, span.start))
            sup_in_turns += (span.end - span.lead) - labels[span.lead : span.end].count(ignore)
            if ends is False:
                eot_missing += 1
            # A turn with no loss at all is history the user chose not to train (multi-turn data trained on
            # the last answer). Within a trained turn, every masked token is a bug; the end-of-turn token is
            # eos-not-learned's business.
            if masked == content_stop - span.start and not (ends and labels[last] != ignore):
                untrained_width += content_stop - span.start
                continue
            trained_any = True
            n_completion_unsup += masked
            if ends and 0 < last < kept and labels[last] == ignore:  # position 0 is never a target (shift)
                eot_unsup += 1
        if not trained_any and n_supervised > 0:  # loss somewhere, but on no completion at all
            n_completion_unsup += untrained_width
        # A row as long as the cut, rendered with this template (its turn markers are there) and with no turn
        # to locate: the cut took the prompt's end and the assistant header, as LLaMA-Factory's cutoff_len does
        # when the prompt is the longer part.
        prompt_cut = bool(cut_at and n >= cut_at and not located and self.markers.locatable) and any(
            i in self.markers.turn_marker_ids for i in ids
        )
        turn_lost = bool(cut_at and n >= cut_at and located and spans and not arrived_cut) and any(
            i not in self.markers.whitespace_ids for i in ids[spans[-1].end :]
        )
        leading_bos = 0
        bos = self.tokenizer.bos_token_id
        while bos is not None and leading_bos < n and ids[leading_bos] == bos:
            leading_bos += 1
        eq_next = eq_same = 0
        if user_labels:
            eq_next = sum(1 for i in range(n - 1) if labels[i] != ignore and labels[i] == ids[i + 1])
            eq_same = sum(1 for i in range(n) if labels[i] != ignore and labels[i] == ids[i])
        return {
            "input_ids": ids,
            "labels": labels,
            "spans": [x for s in spans for x in s.flat()] if located else [],
            "n_tokens": n,
            "n_supervised": n_supervised,
            "n_supervised_kept": kept - labels[:kept].count(ignore),
            "n_turns": len(spans) if located else 0,
            "n_completion": n_completion,
            "n_completion_unsupervised": n_completion_unsup,
            "n_completion_cut": n_completion_cut,
            "arrived_cut": arrived_cut,
            "arrived_turn_lost": turn_lost,
            "arrived_prompt_cut": prompt_cut,
            "n_prompt_supervised": n_supervised - sup_in_turns if located else -1,
            "n_eot_missing": eot_missing,
            "n_eot_unsupervised": eot_unsup,
            "n_leading_bos": leading_bos,
            "n_label_eq_next": eq_next,
            "n_label_eq_same": eq_same,
            "max_id": max(ids) if ids else -1,
            "special_ids": sorted(self._boundaries.intersection(ids)),
        }

    def _finish(self, out: dict[str, Any]) -> dict[str, Any]:
        row = dict(MEASURES)
        row.update({k: v for k, v in out.items() if k in MEASURES})
        row["n_gp_mismatch"], row["n_gp_merge"] = out.get("gp", (0, 0))
        row["content_markers"] = out.get("content", [])
        row["leak"], row["leak_after"] = out.get("leak", (0.0, -1))
        row["n_echo"] = out.get("echo", 0)
        row["text_families"] = out.get("families", [])
        for key in (
            "n_dropped_supervised", "n_supervised_chars", "n_dropped_other", "n_dropped_system", "dropped_text"
        ):  # fmt: skip
            row[key] = out.get(key, MEASURES[key])
        return row

    def failed(self, reason: str) -> dict[str, Any]:
        row = dict(MEASURES)
        row["error"] = reason
        return row


def offsetless_ids(tokenizer, texts: list[str]) -> list[list[int]] | None:
    """``tokenizer(texts, add_special_tokens=False)["input_ids"]`` through the backend's ``encode_batch_fast``,
    which does not track character offsets; None where the tokenizer has no such backend."""
    encode = getattr(getattr(tokenizer, "backend_tokenizer", None), "encode_batch_fast", None)
    if encode is None:
        return None
    return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]
