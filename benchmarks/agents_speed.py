"""The agent and reasoning rules' cost in preflight: 6,400 tool-calling conversations on Qwen2.5's real tokenizer
(`hf_sanity.testing.tool_conversations`, with `--loss-on assistant`), the agent rules (`tool-args-serialization`,
`tools-schema-missing`, `think-unclosed`, `reasoning-field-dropped`, `template-not-prefix-preserving`), the
tool-aware `prompt-in-loss` and `thinking-mode-mismatch` selected: the checks' seconds against the scan's (the
encoding every preflight pays), from ``stats.seconds_by_phase``. One run after a warm-up on 64 rows.
"""

from __future__ import annotations

import time

RULES = ("tool-args-serialization", "tools-schema-missing", "think-unclosed", "reasoning-field-dropped",
         "template-not-prefix-preserving", "prompt-in-loss", "thinking-mode-mismatch")  # fmt: skip


def tokenizer():
    from pathlib import Path

    from transformers import AutoTokenizer

    for root in (
        Path("/work/wt/shared/real-tokenizers"),
        Path(__file__).parents[1] / "shared" / "real-tokenizers",
    ):
        if (root / "qwen2.5-instruct").is_dir():
            return AutoTokenizer.from_pretrained(root / "qwen2.5-instruct")
    return None


def run(*, quick: bool = False) -> dict:
    import datasets

    import hf_sanity
    from hf_sanity.testing import tool_conversations

    tok = tokenizer()
    if tok is None:
        return {"setup": "Qwen2.5's tokenizer not found (shared/real-tokenizers): skipped"}
    rows = 640 if quick else 6_400
    data = datasets.Dataset.from_list(tool_conversations(rows))
    hf_sanity.preflight(tokenizer=tok, dataset=data.select(range(64)), select=list(RULES), use_config=False,
                        loss_on="assistant")  # fmt: skip
    started = time.perf_counter()
    report = hf_sanity.preflight(tokenizer=tok, dataset=data, select=list(RULES), use_config=False,
                                 loss_on="assistant")  # fmt: skip
    total = time.perf_counter() - started
    phases = report.stats["seconds_by_phase"]
    return {
        "setup": f"{rows:,} tool conversations, Qwen2.5 tokenizer, --loss-on assistant",
        "preflight_s": round(total, 2),
        "scan_s": phases["scan"],
        "checks_s": phases["checks"],
        "checks_over_scan": f"{phases['checks'] / max(phases['scan'], 1e-9):.1%}",
        "findings": ", ".join(f.rule for f in report.findings) or "none",
    }
