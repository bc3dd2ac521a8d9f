"""SanityCallback's cost: the median step time of the same training with and without it.

A ~10M-parameter Llama on the demo data; after a warm-up run, runs alternate in ABBA order so that drift and
background load hit both alike; each run's median step time comes from a timing callback present in both.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from transformers import TrainerCallback

BENCH_CONFIG = dict(
    hidden_size=384,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=1536,
    max_position_embeddings=512,
)


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def one_run(with_callback: bool, steps: int, device: str, dtype) -> list[float]:
    import datasets
    import torch
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from hf_sanity.callback import SanityCallback
    from hf_sanity.measure.encode import EncodeOptions, Encoder
    from hf_sanity.testing import TinyConfig, build_tokenizer, demo_conversations, tiny_model_for

    tokenizer = build_tokenizer("chatml", "distinct")
    model = tiny_model_for(tokenizer, TinyConfig(**BENCH_CONFIG)).to(device=device, dtype=dtype)
    encoder = Encoder(tokenizer, EncodeOptions(fmt="messages"))
    rows = [encoder.encode(r) for r in demo_conversations(128)]
    train = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    timer = StepTimer()
    callbacks = [timer] + ([SanityCallback(print_findings=False, use_config=False)] if with_callback else [])
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-sanity-bench-"),
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=1e-4,
        logging_steps=10,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=device == "cpu",
        bf16=dtype == torch.bfloat16,
        disable_tqdm=True,
    )
    # Padding to a multiple of 64 gives most batches one shape, so step times vary less with the data.
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, pad_to_multiple_of=64)
    trainer = Trainer(
        model=model, args=args, train_dataset=train, callbacks=callbacks, data_collator=collator
    )
    trainer.train()
    return timer.times[2:]  # the first steps warm up caches and allocators


def run(*, quick: bool = False, device: str | None = None, dtype=None) -> list[dict]:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    steps, repeats = (20, 1) if quick else (60, 6)
    one_run(False, steps // 2, device, dtype)  # warm-up: allocator, kernels, file caches
    without, with_, paired = [], [], []
    for i in range(repeats):  # ABBA order: neither variant always runs first
        times = {}
        for watched in (False, True) if i % 2 == 0 else (True, False):
            times[watched] = one_run(watched, steps, device, dtype)
        without.append(statistics.median(times[False]))
        with_.append(statistics.median(times[True]))
        # Same seed, same batches: step i of one run is step i of the other, so compare them pairwise.
        paired.append(statistics.median(w / b for w, b in zip(times[True], times[False])))
    base, watched = statistics.median(without), statistics.median(with_)
    from hf_sanity.testing import TinyConfig, build_tokenizer, tiny_model_for

    params = sum(
        p.numel() for p in tiny_model_for(build_tokenizer("chatml"), TinyConfig(**BENCH_CONFIG)).parameters()
    )
    return [
        {
            "device": device,
            "dtype": str(dtype).removeprefix("torch."),
            "params_M": params / 1e6,
            "steps": steps,
            "repeats": repeats,
            "step_ms_without": 1e3 * base,
            "step_ms_with": 1e3 * watched,
            "ratio": watched / base,
            "paired_step_ratio": statistics.median(paired),
        }
    ]
