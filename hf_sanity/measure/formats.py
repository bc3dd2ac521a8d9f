"""Dataset formats, detected from the columns as TRL's SFTTrainer does."""

from __future__ import annotations

from collections.abc import Sequence

from hf_sanity.errors import UserInputError

FORMATS = ("messages", "prompt-completion", "text", "tokens")
ROLES = {"system", "user", "assistant", "tool", "developer", "ipython", "function"}


def detect_format(columns: Sequence[str], override: str | None = None) -> str:
    columns = set(columns)
    if override:
        if override not in FORMATS:
            raise UserInputError(f"unknown --format {override!r}; use one of {', '.join(FORMATS)}")
        needed = {"messages": {"messages"}, "prompt-completion": {"prompt", "completion"},
                  "text": {"text"}, "tokens": {"input_ids"}}[override]  # fmt: skip
        if not needed <= columns:
            raise UserInputError(
                f"--format {override} needs column(s) {sorted(needed)}; the dataset has {sorted(columns)}"
            )
        return override
    if "input_ids" in columns:
        return "tokens"
    if "messages" in columns:
        return "messages"
    if {"prompt", "completion"} <= columns:
        return "prompt-completion"
    if "text" in columns:
        return "text"
    raise UserInputError(
        f"cannot tell the dataset format from its columns {sorted(columns)}; expected `messages`, "
        "`prompt`+`completion`, `text` or `input_ids` (rename a column, or pass --format)"
    )


def conversation_problem(messages) -> str:
    """Why a conversation cannot be trained on as is, or '' when it is fine."""
    if not isinstance(messages, list) or not messages:
        return "empty conversation"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {i} is not a {{role, content}} object"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"message {i} has unknown role {role!r}"
        calls = message.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            return f"message {i} ({role}) has tool_calls that are not an assistant's list of calls"
        if calls:  # a tool-call turn: its calls are what the model writes; text beside them is optional
            if content is not None and not isinstance(content, str):
                return f"message {i} ({role}) content is {type(content).__name__}, not a string"
            continue
        if content is None:
            return f"message {i} ({role}) has no content"
        if not isinstance(content, str):
            return f"message {i} ({role}) content is {type(content).__name__}, not a string"
        if not content.strip() and role in {"user", "assistant"}:
            return f"message {i} ({role}) is empty"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message"
    return ""


def text_problem(value, field: str) -> str:
    if value is None:
        return f"{field} is None"
    if not isinstance(value, str):
        return f"{field} is {type(value).__name__}, not a string"
    if not value.strip():
        return f"{field} is empty"
    return ""
