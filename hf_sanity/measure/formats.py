"""Dataset formats: detected from the columns as TRL's SFTTrainer does, plus the formats people have that TRL
does not read (ShareGPT, Alpaca), each row converted to the TRL row the tools that use them build.

A :class:`Layout` says how one dataset's rows become TRL rows; the encoder converts every row with it, and
the report's stats say what it did (the ShareGPT roles mapped, the Alpaca template, the JSON columns decoded).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hf_sanity.errors import UserInputError

FORMATS = ("messages", "sharegpt", "prompt-completion", "alpaca", "text", "tokens", "preference",
           "preference-unpaired", "prompt-only")  # fmt: skip
# The columns each format needs (Alpaca's `input`, `system` and `history` are optional).
COLUMNS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "prompt-completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
    "tokens": ("input_ids",),
    # Preference data, as TRL's DPO (and ORPO, CPO, reward) and KTO trainers read it (`prompt` optional in pairs:
    # TRL extracts it as the longest common prefix of chosen and rejected).
    "preference": ("chosen", "rejected"),
    "preference-unpaired": ("prompt", "completion", "label"),
    # TRL's "prompt-only" type (trl.data_utils): the prompts of online RL (GRPO, RLOO), text or conversational;
    # the model writes the completions, the reward functions score them.
    "prompt-only": ("prompt",),
}
# Formats of online RL data: read as the RL objective (`measure.objective`), with no completion to train on.
RL_FORMATS = ("prompt-only",)
# Formats that are preference data, and the training objective (`measure.objective`) they imply.
PREFERENCE_FORMATS = {"preference": "preference", "preference-unpaired": "preference-unpaired"}
# What TRL reads a converted row as.
READ_AS = {"sharegpt": "messages", "alpaca": "prompt-completion"}
# Beside the conversation, TRL hands these columns of the row to the chat template (see encode.template_kwargs).
TEMPLATE_COLUMNS = ("tools", "chat_template_kwargs")
ALPACA_TEMPLATES = ("chat", "text")
ROLES = {"system", "user", "assistant", "tool", "developer", "ipython", "function"}

# ShareGPT's `from` values, mapped as Axolotl and LLaMA-Factory read them: Axolotl's chat_template strategy
# (prompt_strategies/chat_template.py, ChatTemplatePrompter's default roles: human/user -> user,
# gpt/assistant -> assistant, system, tool) and LLaMA-Factory's sharegpt tags (data/parser.py DatasetAttr:
# human, gpt, system, observation = the tool's result, function_call = the assistant's call).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",  # Gemma's name for the assistant
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",  # a function's result, as in OpenAI's legacy `function` role
}
FUNCTION_CALL = "function_call"  # LLaMA-Factory: an assistant turn whose value is the call, as JSON

# The Stanford Alpaca prompt (tatsu-lab/stanford_alpaca train.py PROMPT_DICT), which Axolotl's AlpacaPrompter
# also writes; the completion is the output, EOS appended (as TRL does for text).
ALPACA_PREAMBLE = {
    True: "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.",
    False: "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.",
}
# A converted Alpaca text row keeps the user's own texts under this key: the stray-marker and leakage checks
# read them, not the `### Instruction:` scaffolding the template wrote around them.
USER_TEXTS = "_user_texts"


def label_is_boolean(features) -> bool | None:
    """Whether the dataset's ``label`` column holds booleans, as TRL's KTOTrainer needs (None: no features to
    tell, e.g. a bare list of column names)."""
    if features is None or "label" not in features:
        return None
    return getattr(features["label"], "dtype", None) == "bool"


def string_label_note(columns: Sequence[str], features) -> str | None:
    """The report's note when a `label` column beside prompt/completion is read as SFT data, not KTO's."""
    if not {"prompt", "completion", "label"} <= set(columns) or label_is_boolean(features) is not False:
        return None
    kind = getattr(features["label"], "dtype", type(features["label"]).__name__)
    return (
        f"the `label` column holds {kind} values, not booleans: read as SFT prompt-completion data (TRL's "
        "KTOTrainer needs a boolean `label`, True for a desirable completion); pass --format preference-unpaired "
        "to check it as KTO data"
    )


def detect_format(columns: Sequence[str], override: str | None = None, *, features=None) -> str:
    """The format of a dataset with ``columns`` (``features``: its column types, which tell KTO's boolean
    `label` from a classification-style SFT label; without them a `label` column is read as KTO's)."""
    columns = set(columns)
    if override:
        if override not in FORMATS:
            raise UserInputError(f"unknown --format {override!r}; use one of {', '.join(FORMATS)}")
        needed = set(COLUMNS[override])
        if not needed <= columns:
            raise UserInputError(
                f"--format {override} needs column(s) {sorted(needed)}; the dataset has {sorted(columns)}"
            )
        return override
    # TRL's order first (a `text` column wins over Alpaca's columns, as TRL trains on it), then ShareGPT and
    # Alpaca, which TRL does not read.
    if "input_ids" in columns:
        return "tokens"
    if {"chosen", "rejected"} <= columns:
        return "preference"
    if {"prompt", "completion", "label"} <= columns and label_is_boolean(features) is not False:
        return "preference-unpaired"
    if "messages" in columns:
        return "messages"
    if "conversations" in columns:
        return "sharegpt"
    if {"prompt", "completion"} <= columns:
        return "prompt-completion"
    if "text" in columns:
        return "text"
    if {"instruction", "output"} <= columns:
        return "alpaca"
    if "prompt" in columns:  # a prompt and no completion: what GRPO and RLOO train on (TRL's "prompt-only")
        return "prompt-only"
    raise UserInputError(
        f"cannot tell the dataset format from its columns {sorted(columns)}; expected `messages`, `conversations` "
        "(ShareGPT), `prompt`+`completion`, `instruction`+`output` (Alpaca), `text` or `input_ids`, each with "
        "an optional `tools` column, `prompt` alone (RL prompts, GRPO/RLOO), or preference data: `chosen`+`rejected` (optional `prompt`) or "
        "`prompt`+`completion`+`label` (KTO) (rename a column, or pass --format)"
    )


def read_as(fmt: str) -> str:
    """The TRL format a dataset of format ``fmt`` is read as."""
    return READ_AS.get(fmt, fmt)


def check_alpaca_template(value: str | None) -> None:
    if value is not None and value not in ALPACA_TEMPLATES:
        raise UserInputError(f"--alpaca-template must be 'chat' or 'text', got {value!r}")


@dataclass(frozen=True)
class Layout:
    """How the rows of a dataset of format ``fmt`` become the rows TRL reads (picklable, for ``num_proc``).

    ``alpaca_template``: ``chat`` (instruction and input as the user turn, the output as the assistant turn,
    rendered by the chat template) or ``text`` (the Alpaca prompt, for base models without a chat template).
    """

    fmt: str
    alpaca_template: str = "chat"

    @classmethod
    def of(cls, fmt: str, *, has_template: bool, alpaca_template: str | None = None) -> Layout:
        check_alpaca_template(alpaca_template)
        return cls(fmt, alpaca_template or ("chat" if has_template else "text"))

    @property
    def read_as(self) -> str:
        return read_as(self.fmt)

    def to_trl(self, row: dict[str, Any]) -> dict[str, Any] | str:
        """The row as TRL reads it, or why it cannot be read (one line)."""
        if self.fmt == "messages":
            messages = _json_list(row.get("messages"), "messages")
            return messages if isinstance(messages, str) else {**row, "messages": messages}
        if self.fmt == "prompt-completion":
            return {
                **row,
                "prompt": _json_messages_or_text(row.get("prompt")),
                "completion": _json_messages_or_text(row.get("completion")),
            }
        if self.fmt == "sharegpt":
            return _from_sharegpt(row)
        if self.fmt == "alpaca":
            return _from_alpaca(row, self.alpaca_template)
        return row

    def describe(self, dataset) -> dict[str, Any]:
        """What the report's stats say about the format: what it was read as, and how."""
        out: dict[str, Any] = {"format": self.fmt}
        if self.read_as != self.fmt:
            out["read_as"] = self.read_as
        if self.fmt == "sharegpt":
            out["roles"] = {role: _sharegpt_role(role) for role in sharegpt_roles_seen(dataset)}
        if self.fmt == "alpaca":
            out["alpaca_template"] = self.alpaca_template
        decoded = json_columns(dataset, self.fmt)
        if decoded:
            out["json_columns"] = decoded
        used = [c for c in TEMPLATE_COLUMNS if c in dataset.column_names]
        if used and self.read_as in ("messages", "prompt-completion"):
            out["template_columns"] = used
        return out


def conversation_of(row: dict[str, Any]) -> list[dict] | None:
    """The messages a TRL row renders through the chat template (None for plain text)."""
    if isinstance(row.get("messages"), list):
        return row["messages"]
    if isinstance(row.get("prompt"), list) and isinstance(row.get("completion"), list):
        return row["prompt"] + row["completion"]
    return None


# -- conversions -------------------------------------------------------------------------------------------
def _json_list(value, column: str) -> Any:
    """A conversation column's value; a JSON string (CSV, Parquet written by pandas) decoded. A string that does
    not hold a list is a problem, returned as a string."""
    if not isinstance(value, str):
        return value
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError as exc:
        return (
            f"column `{column}` holds a string that is not JSON ({exc.msg}); expected a list of messages "
            "(JSON-decode it)"
        )
    if not isinstance(decoded, list):
        return f"column `{column}` holds strings; expected a list of messages (JSON-decode it)"
    return decoded


def _json_messages_or_text(value):
    """A prompt or completion: plain text as it is; a JSON string of a message list decoded."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        if isinstance(decoded, list) and decoded and all(isinstance(m, dict) for m in decoded):
            return decoded
    return value


def _sharegpt_role(source) -> str | None:
    if source == FUNCTION_CALL:
        return "assistant"
    return SHAREGPT_ROLES.get(source, source if source in ROLES else None)


def _from_sharegpt(row: dict[str, Any]) -> dict[str, Any] | str:
    conversation = _json_list(row.get("conversations"), "conversations")
    if isinstance(conversation, str):
        return conversation
    if not isinstance(conversation, list):
        return {**row, "messages": conversation}  # conversation_problem says what is wrong with it
    messages = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            messages.append(message)
            continue
        # {from, value} as ShareGPT writes it; {role, content} inside a `conversations` column is read too.
        source = message["from"] if message.get("from") is not None else message.get("role")
        value = message["value"] if message.get("value") is not None else message.get("content")
        rest = {k: v for k, v in message.items() if k not in ("from", "value", "role", "content")}
        role = _sharegpt_role(source)
        if role is None:
            return (
                f"message {i} has unknown ShareGPT role {source!r} (read: "
                f"{', '.join([*SHAREGPT_ROLES, FUNCTION_CALL])})"
            )
        if source == FUNCTION_CALL:
            calls = _function_calls(value)
            if calls is None:
                return f"message {i} (function_call) is not a JSON call {{name, arguments}} or a list of them"
            messages.append({**rest, "role": "assistant", "content": "", "tool_calls": calls})
        else:
            messages.append({**rest, "role": role, "content": value})
    system = row.get("system")  # LLaMA-Factory's optional system column
    if isinstance(system, str) and system.strip() and not (messages and _role(messages[0]) == "system"):
        messages.insert(0, {"role": "system", "content": system})
    out = {k: v for k, v in row.items() if k != "conversations"}
    out["messages"] = messages
    return out


def _role(message) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _function_calls(value) -> list[dict] | None:
    """LLaMA-Factory's function_call value (``{"name", "arguments"}`` or a list of them, as JSON) as the
    assistant's ``tool_calls``."""
    try:
        decoded = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return None
    calls = decoded if isinstance(decoded, list) else [decoded]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    return [
        {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
        for c in calls
    ]


def _from_alpaca(row: dict[str, Any], template: str) -> dict[str, Any] | str:
    instruction, given, output = row.get("instruction"), row.get("input") or "", row.get("output")
    problem = text_problem(instruction, "instruction") or text_problem(output, "output")
    if problem or not isinstance(given, str):
        return problem or f"input is {type(given).__name__}, not a string"
    system = row.get("system") if isinstance(row.get("system"), str) else ""
    out = {k: v for k, v in row.items() if k not in ("instruction", "input", "output", "system", "history")}
    if template == "text":
        preamble = system.strip() or ALPACA_PREAMBLE[bool(given.strip())]
        prompt = f"{preamble}\n\n### Instruction:\n{instruction}\n\n"
        if given.strip():
            prompt += f"### Input:\n{given}\n\n"
        out.update(prompt=prompt + "### Response:\n", completion=output)
        out[USER_TEXTS] = ["\n".join(t for t in (system, instruction, given) if t), output]
        return out
    # LLaMA-Factory's AlpacaDatasetConverter: the user turn is instruction and input joined by a newline, the
    # history pairs are earlier turns, the system column the system turn. TRL trains the completion only.
    prompt: list[dict[str, Any]] = [{"role": "system", "content": system}] if system.strip() else []
    for pair in row.get("history") or []:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            return "history is not a list of [instruction, response] pairs"
        prompt += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt.append({"role": "user", "content": "\n".join(t for t in (instruction, given) if t)})
    out.update(prompt=prompt, completion=[{"role": "assistant", "content": output}])
    return out


# -- what the stats say --------------------------------------------------------------------------------------
def sharegpt_roles_seen(dataset) -> list[str]:
    """Every ShareGPT ``from`` value of the dataset (Arrow, no Python pass over the rows), or, for a column of
    JSON strings, of its first 1,000 rows."""
    try:
        import pyarrow.compute as pc

        # The selected rows (a dataset after .select/.shuffle maps indices over its table).
        column = dataset.select_columns(["conversations"]).with_format("arrow")[:]["conversations"]
        messages = pc.list_flatten(column)
        values = []
        for key in ("from", "role"):
            if key in {f.name for f in messages.type}:
                values += pc.unique(pc.struct_field(messages, key)).to_pylist()
        return sorted({v for v in values if v is not None})
    except Exception:  # strings, or a struct Arrow cannot flatten: read a sample
        seen: set[str] = set()
        for value in dataset.select(range(min(1000, len(dataset))))["conversations"]:
            value = _json_list(value, "conversations")
            if isinstance(value, list):
                seen.update(str(m.get("from", m.get("role"))) for m in value if isinstance(m, dict))
        return sorted(seen)


def json_columns(dataset, fmt: str) -> list[str]:
    """The conversation columns that hold JSON strings (decoded for reading)."""
    names = {
        "messages": ("messages",),
        "sharegpt": ("conversations",),
        "prompt-completion": ("prompt", "completion"),
    }
    out = []
    for column in names.get(fmt, ()):
        feature = dataset.features.get(column)
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            continue
        first = next((v for v in dataset.select(range(min(16, len(dataset))))[column] if v), None)
        if column in ("messages", "conversations") or isinstance(_json_messages_or_text(first), list):
            out.append(column)
    return out


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


# -- preference rows -------------------------------------------------------------------------------------
def loaded_trl_data_utils():
    """``trl.data_utils`` when TRL is already loaded (a TRL trainer's run: the installed version's own functions),
    else None: importing TRL costs seconds, and it need not be installed (the ports below stand in for it)."""
    import sys

    return sys.modules.get("trl.data_utils")


def is_conversational(value: Any) -> bool:
    """A list of chat messages (TRL's ``is_conversational`` on one column's value)."""
    if not isinstance(value, list) or not value:
        return False
    trl = loaded_trl_data_utils()
    if trl is not None and hasattr(trl, "is_conversational"):
        return bool(trl.is_conversational({"messages": value}))
    return isinstance(value[0], dict) and "role" in value[0]


def extract_prompt(chosen, rejected) -> tuple[Any, Any, Any]:
    """TRL's ``extract_prompt``: the longest common prefix (messages, or characters) of chosen and rejected."""
    trl = loaded_trl_data_utils()
    if (
        trl is not None and hasattr(trl, "extract_prompt") and len(chosen) and len(rejected)
    ):  # TRL's needs both
        split = trl.extract_prompt({"chosen": chosen, "rejected": rejected})
        return split["prompt"], split["chosen"], split["rejected"]
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]
