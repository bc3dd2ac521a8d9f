"""Chat templates for training: `{% generation %}` markers, TRL's training twins, and the assistant mask.

TRL's ``assistant_only_loss=True`` takes its loss mask from ``apply_chat_template(return_assistant_tokens_mask=
True)``, which marks what a template renders between ``{% generation %}`` and ``{% endgeneration %}``. Most
templates have no such markers; TRL ships a training twin (``trl/chat_templates/*_training.jinja``) for the
templates it knows, matched by the exact text of the original. For the rest, :func:`wrap_assistant_content`
rewrites the expression that prints a message's content so that, for assistant messages, the content and what
follows it in that expression (the end-of-turn token) sit inside the markers; the text rendered is unchanged
by construction, and :func:`mask_problems` checks the mask against the completions located from the template.
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path

from hf_sanity.measure.markers import Span

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_markers(template) -> bool:
    """Whether the template marks the assistant's output with ``{% generation %}`` (the ``default`` variant of
    a template shipped as named variants), as TRL checks it."""
    if isinstance(template, dict):
        template = template.get("default", "")
    return isinstance(template, str) and _GENERATION.search(template) is not None


@lru_cache(maxsize=1)
def _trl_templates() -> dict[str, tuple[str, str]]:
    """TRL's library: original template text -> (twin's name, training twin text); {} without TRL."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return {}
    folder = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
    out = {}
    for twin in sorted(folder.glob("*_training.jinja")):
        original = folder / twin.name.replace("_training.jinja", ".jinja")
        if original.is_file():
            out[original.read_text(encoding="utf-8")] = (twin.name, twin.read_text(encoding="utf-8"))
    return out


def training_twin(template) -> tuple[str, str] | None:
    """(file name, text) of TRL's training twin of ``template`` when it is one of TRL's originals, character
    for character (trailing whitespace aside, as files and hub configs differ there); None otherwise."""
    if not isinstance(template, str):
        return None
    library = _trl_templates()
    found = library.get(template)
    if found is None:
        found = next((twin for text, twin in library.items() if text.strip() == template.strip()), None)
    return found


_OUTPUT = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.S)
_LOOP = re.compile(r"\{%-?\s*for\s+(\w+)\s+in\s+(\w+)")


def wrap_assistant_content(template: str) -> str | None:
    """``template`` with, in each expression that prints a message's content, the content and what the
    expression prints after it wrapped in ``{% generation %}`` for assistant messages (the other roles print as
    before); None when no such expression is found (content printed from a variable set elsewhere, as
    Llama-3's template does) or the template already has markers."""
    if not isinstance(template, str) or has_generation_markers(template):
        return None
    names = {var for var, iterable in _LOOP.findall(template) if "messages" in iterable}
    if not names:
        return None
    content = re.compile(
        r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\s*(?:\[\s*['\"]content['\"]\s*\]|\.content\b)"
    )
    changed = False

    def rewrite(match: re.Match) -> str:
        nonlocal changed
        left, expression, right = match.groups()
        found = content.search(expression)
        terms = _terms(expression) if found else None
        if not terms:
            return match.group(0)
        at = next(k for k, (term, _) in enumerate(terms) if content.search(term))
        var = content.search(terms[at][0]).group(1)
        before = "".join(term + op for term, op in terms[: at - 1]) + terms[at - 1][0] if at else ""
        after = "".join(term + op for term, op in terms[at:-1]) + terms[-1][0]
        changed = True
        printed = f"{{{{ {before.strip()} }}}}" if before.strip() else ""
        # Printing '' on both sides keeps the whitespace around the expression as it was: transformers renders
        # with trim_blocks and lstrip_blocks, which would eat a newline after (and indentation before) a block tag.
        return (
            f"{{{{{left} '' }}}}{{% if {var}['role'] == 'assistant' %}}{printed}{{% generation %}}"
            f"{{{{ {after.strip()} }}}}{{% endgeneration %}}{{% else %}}{{{{{expression}}}}}{{% endif %}}"
            f"{{{{ '' {right}}}}}"
        )

    out = _OUTPUT.sub(rewrite, template)
    return out if changed else None


def _terms(expression: str) -> list[tuple[str, str]] | None:
    """``expression`` split at its top-level ``+`` and ``~`` as (term, the operator after it); None when it has
    a top-level conditional (splitting it would change what it prints)."""
    terms, depth, quote, start = [], 0, "", 0
    i = 0
    while i < len(expression):
        ch = expression[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in "+~":
            terms.append((expression[start:i], ch))
            start = i + 1
        elif depth == 0 and re.match(r"\s(if|else)\s", expression[i : i + 6]):
            return None
        i += 1
    terms.append((expression[start:], ""))
    return terms


def mask_problems(mask: list[int], spans: list[Span], labels: list[int], ignore: int) -> tuple[int, int]:
    """(answer tokens the assistant mask leaves out, prompt tokens it takes in) for one row: the mask must
    cover each trained completion and its end-of-turn token (``[start, stop)`` where labels carry loss) and
    may take in the turn's own scaffolding and whitespace around it (``[lead, end)``), nothing else."""
    allowed = [False] * len(mask)
    missed = 0
    for span in spans:
        for p in range(span.lead, min(span.end, len(mask))):
            allowed[p] = True
        missed += sum(
            1 for p in range(span.start, min(span.stop, len(mask))) if labels[p] != ignore and not mask[p]
        )
    extra = sum(1 for p, m in enumerate(mask) if m and not allowed[p])
    return missed, extra
