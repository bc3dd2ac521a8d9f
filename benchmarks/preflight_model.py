"""preflight at real vocabulary size: the model-side checks against the data-only preflight, and the defaults
against a bare chat-template pass, each run in its own process (so each peak RSS is that run's own).

Two rows, both with the real Qwen2.5 tokenizer (vocabulary 151,665) from ``../shared/real-tokenizers``:

* model side: a 2-layer, hidden-64 Llama built for that tokenizer (the vocabulary projection is nearly all of
  its cost: the case the chunked scoring exists for), 1,500 multi-turn conversations of ~900 tokens; the full
  preflight (defaults) against ``--select data,tokens,template``.
* 20k: 20,000 short conversations (~250 tokens), the full preflight against a bare ``datasets.map`` that
  applies the chat template and tokenizes (what any SFT pipeline pays anyway).

Runs alternate (bare/data-only, then full) so that drift hits both; medians of the repeats.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

QWEN = Path(__file__).resolve().parents[2] / "shared" / "real-tokenizers" / "qwen2.5-instruct"
MODEL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    max_position_embeddings=4096,
)


def _rss_gb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def worker(kind: str, n: int, words: int) -> dict:
    """One measured run in this process: ``bare``, ``data`` (data-only preflight) or ``full``."""
    import datasets
    from transformers import AutoTokenizer

    from hf_sanity.drivers.preflight import preflight
    from hf_sanity.testing import TinyConfig, synthetic_conversations, tiny_model_for

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(QWEN)
    data = datasets.Dataset.from_list(synthetic_conversations(n, words=words))
    model = tiny_model_for(tokenizer, TinyConfig(**MODEL)) if kind == "full" else None
    if model is not None:
        import torch

        if torch.cuda.is_available():  # where there is a GPU, the model checks run there in bf16
            model = model.to(device="cuda", dtype=torch.bfloat16)
    before = _rss_gb("VmRSS")
    started = time.perf_counter()
    stats: dict = {}
    if kind == "bare":
        from benchmarks.preflight_speed import bare_tokenize

        tokens = bare_tokenize(tokenizer, data, None)
        stats["tokens"] = sum(len(ids) for ids in tokens["input_ids"])
    else:
        select = ["data", "tokens", "template"] if kind == "data" else None
        report = preflight(model=model, tokenizer=tokenizer, dataset=data, select=select, use_config=False)
        stats = {k: report.stats[k] for k in ("tokens", "seconds_by_phase")}
        stats["findings"] = sorted({f.rule for f in report.findings})
    wall = time.perf_counter() - started
    return {"wall_s": wall, "peak_added_gb": _rss_gb("VmHWM") - before, "peak_gb": _rss_gb("VmHWM"), **stats}


def measured(kind: str, n: int, words: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [sys.executable, "-m", "benchmarks.preflight_model", kind, str(n), str(words)]
    done = subprocess.run(
        args, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1]
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(base_kind: str, n: int, words: int, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {base_kind: [], "full": []}
    for _ in range(repeats):
        for kind in (base_kind, "full"):
            runs[kind].append(measured(kind, n, words))
    full = runs["full"]
    wall = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    peak = {k: statistics.median(r["peak_gb"] for r in v) for k, v in runs.items()}
    phases = full[0]["seconds_by_phase"]
    import torch

    return {
        "model_on": "cuda (bf16)" if torch.cuda.is_available() else "cpu (float32)",
        "conversations": n,
        "tokens_per_conversation": round(full[0]["tokens"] / n),
        "baseline": "bare map" if base_kind == "bare" else "data-only preflight",
        "baseline_s": wall[base_kind],
        "full_s": wall["full"],
        "ratio": wall["full"] / wall[base_kind],
        "baseline_peak_gb": peak[base_kind],
        "full_peak_gb": peak["full"],
        "added_peak_gb": peak["full"] - peak[base_kind],
        "full_split_s": " / ".join(f"{k} {v:.1f}" for k, v in phases.items()),
        "findings": ",".join(full[0]["findings"]) or "none",
    }


def run(*, quick: bool = False) -> list[dict]:
    if not QWEN.is_dir():
        return []
    repeats = 1 if quick else 3
    return [
        compare("data", 300 if quick else 1_500, 200, repeats),
        compare("bare", 2_000 if quick else 20_000, 60, repeats),
    ]


if __name__ == "__main__":
    kind, n, words = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(worker(kind, n, words)))
