"""Preflight scan time against a bare tokenization pass over the same data.

The baseline is what any SFT pipeline pays anyway: a `datasets.map` that applies the chat template and
tokenizes. preflight does that plus every measurement and every data/token/template rule. Both run with the
same num_proc, from a fresh (uncached) map.
"""

from __future__ import annotations

import statistics
import time

import datasets

from hf_sanity.drivers.preflight import preflight
from hf_sanity.testing import synthetic_conversations


def bare_tokenize(tokenizer, dataset, num_proc):
    def encode(batch):
        return {"input_ids": [tokenizer.apply_chat_template(m)["input_ids"] for m in batch["messages"]]}

    return dataset.map(
        encode,
        batched=True,
        batch_size=256,
        num_proc=num_proc,
        remove_columns=dataset.column_names,
        load_from_cache_file=False,
    )


def timed(fn, *args, **kwargs) -> float:
    started = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started


def run(tokenizer, sizes=(2_000, 20_000), repeats=3, num_proc=None, label="") -> list[dict]:
    datasets.disable_progress_bars()
    rows = []
    for n in sizes:
        data = datasets.Dataset.from_list(synthetic_conversations(n))
        bare, scan = [], []
        for _ in range(repeats):  # alternate, so drift hits both alike
            bare.append(timed(bare_tokenize, tokenizer, data, num_proc))
            scan.append(
                timed(
                    preflight,
                    tokenizer=tokenizer,
                    dataset=data,
                    max_len=1024,
                    num_proc=num_proc,
                    select=["data", "tokens", "template"],
                    use_config=False,
                )
            )
        b, s = statistics.median(bare), statistics.median(scan)
        rows.append(
            {
                "tokenizer": label,
                "conversations": n,
                "num_proc": num_proc or 1,
                "bare_s": b,
                "preflight_s": s,
                "ratio": s / b,
                "preflight_us_per_conversation": 1e6 * s / n,
            }
        )
    return rows
