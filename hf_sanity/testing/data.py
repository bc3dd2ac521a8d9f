"""A small, deterministic SFT dataset: short questions with one right answer each.

Short answers let the tiny models overfit them in seconds, so a broken pipeline (prompt in the loss, EOS
masked, answers truncated) shows up as a clear difference, not as noise.
"""

from __future__ import annotations

import random
from typing import Any

CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Norway", "Oslo"),
    ("Greece", "Athens"), ("Chile", "Santiago"), ("Poland", "Warsaw"), ("Cuba", "Havana"), ("Iran", "Tehran"),
]  # fmt: skip
CAPITALS_TEXT = [f"{country} {capital}" for country, capital in CAPITALS]
WORDS = ["cat", "dog", "bird", "tree", "house", "river", "apple", "bread", "music", "honey", "green", "stone"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly and precisely."]


def _qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        country, capital = rng.choice(CAPITALS)
        return f"What is the capital of {country}?", f"The capital of {country} is {capital}."
    if kind == 1:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 2:
        word = rng.choice(WORDS)
        return f"Please spell the word {word} backwards.", f"The word {word} backwards is {word[::-1]}."
    n = rng.randrange(11)
    return f"Write the number {n} in words.", f"{n} in words is {NUMBER_WORDS[n]}."


def demo_conversations(n: int = 64, seed: int = 0, *, multi_turn_every: int = 5) -> list[dict[str, Any]]:
    """``n`` rows of ``{"messages": [...]}``; every ``multi_turn_every``-th row has two exchanges, and
    every third row a system prompt."""
    rng = random.Random(seed)
    rows = []
    seen: set[str] = set()  # no duplicates: a clean dataset must not trip duplicate-examples
    for _attempt in range(50 * n + 100):
        if len(rows) == n:
            break
        i = len(rows)
        messages = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]})
        exchanges = 2 if multi_turn_every and i % multi_turn_every == multi_turn_every - 1 else 1
        for _ in range(exchanges):
            question, answer = _qa(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        key = repr(messages)
        if key not in seen:
            seen.add(key)
            rows.append({"messages": messages})
    if len(rows) < n:
        raise ValueError(
            f"demo_conversations has only about {len(rows)} distinct rows; use synthetic_conversations"
        )
    return rows


def synthetic_conversations(n: int, seed: int = 0, *, words: int = 60) -> list[dict[str, Any]]:
    """``n`` conversations of random words (about ``words`` per message), for benchmarks at any size."""
    rng = random.Random(seed)
    vocabulary = [w for w in " ".join(CAPITALS_TEXT).split() if w.isalpha()] + WORDS + NUMBER_WORDS

    def sentence() -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(rng.randint(words // 2, words * 3 // 2))) + "."

    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if i % 3 == 0 else []
        for _ in range(1 + (i % 4 == 3)):
            messages += [
                {"role": "user", "content": sentence()},
                {"role": "assistant", "content": sentence()},
            ]
        rows.append({"messages": messages})
    return rows


def as_prompt_completion(rows: list[dict[str, Any]], *, conversational: bool = False) -> list[dict[str, Any]]:
    """Split each conversation before its last assistant turn (TRL's prompt-completion format)."""
    out = []
    for row in rows:
        messages = row["messages"]
        if conversational:
            out.append({"prompt": messages[:-1], "completion": messages[-1:]})
        else:
            prompt = "\n".join(m["content"] for m in messages[:-1])  # system prompt and history included
            out.append({"prompt": prompt + "\n", "completion": messages[-1]["content"]})
    return out


def as_text(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Plain prose rows (the `text` format), no chat markers."""
    return [
        {"text": " ".join(m["content"] for m in row["messages"] if m["role"] != "system")} for row in rows
    ]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current temperature in a city, in degrees Celsius.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city."}},
            "required": ["city"],
        },
    },
}


def tool_conversations(n: int = 32, seed: int = 0, *, tools_as_json: bool = False) -> list[dict[str, Any]]:
    """``n`` tool-calling conversations in the TRL/OpenAI format: a user question, an assistant turn that is
    only a call (``content: ""`` plus ``tool_calls``), the ``tool`` result, and the answer; the ``tools``
    column carries the function schema (a JSON string with ``tools_as_json``, as CSV/Parquet files hold it)."""
    import json

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        _, city = CAPITALS[i % len(CAPITALS)]
        degrees = rng.randrange(-5, 35)
        call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"How warm is it in {city} right now? ({i})"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "get_weather", "content": json.dumps({"celsius": degrees})},
                    {"role": "assistant", "content": f"It is {degrees} degrees Celsius in {city}."},
                ],
                "tools": json.dumps([WEATHER_TOOL]) if tools_as_json else [WEATHER_TOOL],
            }
        )
    return rows


def reasoning_conversations(n: int = 32, seed: int = 0) -> list[dict[str, Any]]:
    """:func:`demo_conversations` whose answers carry a reasoning block, ``<think>\\n...\\n</think>\\n\\n`` before
    the answer, as reasoning models (DeepSeek-R1, Qwen3) write them."""
    rows = []
    for row in demo_conversations(n, seed):
        messages = []
        for m in row["messages"]:
            if m["role"] == "assistant":
                thought = f"The user asks: {messages[-1]['content']} I know this one."
                m = {**m, "content": f"<think>\n{thought}\n</think>\n\n{m['content']}"}
            messages.append(m)
        rows.append({"messages": messages})
    return rows


def _wrong(answer: str, rng: random.Random) -> str:
    """The answer with its value replaced by a wrong one of the same kind (a capital, a sum, a spelling, a number
    word), so that chosen and rejected differ in content and only by chance in length."""
    words = answer.rstrip(".").split(" ")
    last = words[-1]
    if last.isdigit():
        words[-1] = str(int(last) + rng.choice([-3, -2, -1, 1, 2, 3, 11, 25]))
    elif last in NUMBER_WORDS:
        words[-1] = rng.choice([w for w in NUMBER_WORDS if w != last])
    elif any(last == capital for _, capital in CAPITALS):
        words[-1] = rng.choice([c for _, c in CAPITALS if c != last])
    else:
        words[-1] = rng.choice([w for w in WORDS if w != last[::-1]])[::-1]
    return " ".join(words) + "."


def demo_preference_pairs(n: int = 64, seed: int = 0, *, conversational: bool = True) -> list[dict[str, Any]]:
    """``n`` preference pairs (``prompt``/``chosen``/``rejected``) built from :func:`demo_conversations`: the
    right answer is chosen, the same answer with a wrong value rejected. Conversational (TRL's messages) or
    plain text; lengths differ only by chance, so no content-blind rule separates them."""
    rng = random.Random(seed + 1)
    rows = []
    for row in demo_conversations(n, seed, multi_turn_every=0):
        messages = row["messages"]
        answer = messages[-1]["content"]
        wrong = _wrong(answer, rng)
        if conversational:
            rows.append({
                "prompt": messages[:-1],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": wrong}],
            })  # fmt: skip
        else:
            prompt = "\n".join(m["content"] for m in messages[:-1]) + "\n"
            rows.append({"prompt": prompt, "chosen": answer, "rejected": wrong})
    return rows


def demo_unpaired(n: int = 64, seed: int = 0, *, conversational: bool = True) -> list[dict[str, Any]]:
    """KTO rows (``prompt``/``completion``/``label``) from :func:`demo_preference_pairs`, shuffled: about half the
    completions are the right answer (desirable), half a wrong one."""
    rng = random.Random(seed + 2)
    rows = []
    for pair in demo_preference_pairs(n, seed, conversational=conversational):
        good = rng.random() < 0.5
        rows.append(
            {"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good}
        )
    return rows


def demo_rl_prompts(n: int = 32, seed: int = 0, *, conversational: bool = True) -> list[dict[str, Any]]:
    """``n`` rows for an RL trainer (GRPO, RLOO) built from :func:`demo_conversations`: ``prompt`` (the conversation
    up to its last user turn: TRL's messages, or its user turns as plain text) and ``answer``, the reference
    answer a reward function can compare a completion with (TRL passes it as the ``answer`` keyword)."""
    rows = []
    for row in demo_conversations(n, seed, multi_turn_every=0):
        messages = row["messages"]
        prompt = messages[:-1] if conversational else "\n".join(m["content"] for m in messages[:-1]) + "\n"
        rows.append({"prompt": prompt, "answer": messages[-1]["content"]})
    return rows
