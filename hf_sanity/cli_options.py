"""The command line's options, each declared once (its flag, type and help), and the option blocks that
several commands share (`with_options`). Flags are a public contract: a rename here is a breaking change."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer

SelectOpt = Annotated[
    list[str] | None,
    typer.Option("--select", help="Only these rules (slugs, stages or ALL; repeat or comma-separate)."),
]
IgnoreOpt = Annotated[
    list[str] | None, typer.Option("--ignore", help="Silence these rules (slugs or stages).")
]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON to this file.")]
HtmlOpt = Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML report page.")]

# Options that several commands share: one definition each.
ModelOpt = Annotated[
    str, typer.Option(help="Model folder or hub id (its tokenizer is used unless --tokenizer).")
]
DatasetOpt = Annotated[str, typer.Option(help="JSON/JSONL/CSV/Parquet file, save_to_disk folder, or hub id.")]
TokenizerOpt = Annotated[str | None, typer.Option(help="Tokenizer folder or hub id (default: --model).")]
SplitOpt = Annotated[str, typer.Option(help="Dataset split to use.")]
MaxLenOpt = Annotated[int | None, typer.Option(help="Training max_length (truncation keeps the start).")]
LossOnOpt = Annotated[str, typer.Option(help="completion (labels on completions only) or all.")]
FORMAT_HELP = (
    "messages, sharegpt, prompt-completion, alpaca, text, tokens, preference (chosen/rejected, optional prompt) or "
    "preference-unpaired (KTO's prompt/completion/label) or prompt-only (RL prompts for GRPO/RLOO, read as the RL "
    "objective) (default: detected from the columns)."
)
FormatOpt = Annotated[str | None, typer.Option("--format", help=FORMAT_HELP)]
UnsafeFixesOpt = Annotated[
    bool,
    typer.Option(
        "--unsafe-fixes",
        help="Apply the unsafe remedies too: those that change the data (rows dropped or edited, a training argument) "
        "or the vocabulary and weights.",
    ),
]
LOSS_ON_HELP = (
    "Which tokens carry loss: completion (TRL's completion_only_loss), assistant (the assistant turns, from the "
    "chat template's {% generation %} markers, as TRL's assistant_only_loss; Axolotl's and LLaMA-Factory's "
    "default) or all. Default: what TRL's SFTTrainer does with the format (every token of messages and text "
    "rows, the completion of prompt-completion rows); the report says which it assumed."
)
TrlLossOnOpt = Annotated[str | None, typer.Option(help=LOSS_ON_HELP)]
ObjectiveOpt = Annotated[
    str | None,
    typer.Option(
        help="What the model was trained for: sft, preference, preference-unpaired, reward or rl (default: read from "
        "the dataset's columns). Preference and RL runs get policy-drift against --base."
    ),
]
AlpacaOpt = Annotated[
    str | None,
    typer.Option(
        help="Alpaca rows: chat (the chat template renders instruction+input, then output) or text (the "
        "Alpaca prompt, for base models). Default: chat when the tokenizer has a chat template."
    ),
]
TrustOpt = Annotated[bool, typer.Option(help="Allow custom model/tokenizer code.")]
# The options that shape the checks, declared once: preflight's, and fix's (which passes them on).
CheckAdapterOpt = Annotated[
    str | None, typer.Option(help="A saved PEFT adapter folder to check against the model.")
]
InferenceTokenizerOpt = Annotated[
    str | None, typer.Option(help="Tokenizer used at inference, for template parity.")
]
TaskOpt = Annotated[
    str,
    typer.Option(
        help="generative, or extractive when answers quote the prompt (extractive QA, RAG with "
        "citations): the answer in the prompt is then not label-leakage."
    ),
]
SampleOpt = Annotated[int, typer.Option(help="Examples for the model-side checks.")]
NumProcOpt = Annotated[int | None, typer.Option(help="Processes for tokenization.")]
AdapterConfigOpt = Annotated[
    Path | None, typer.Option(help="A LoRA adapter_config.json (or its folder) to attach, as in training.")
]
LoraROpt = Annotated[int | None, typer.Option(help="Attach a LoRA adapter of this rank.")]
LoraAlphaOpt = Annotated[int | None, typer.Option(help="LoRA alpha (default: 2 x rank).")]
LoraTargetOpt = Annotated[
    list[str] | None, typer.Option(help="LoRA target modules (repeat or comma-separate; default all-linear).")
]
ExamplesOpt = Annotated[int, typer.Option("--n", help="Examples to overfit (2-10).")]
StepsOpt = Annotated[int, typer.Option(help="Step budget of the overfit.")]
LrOpt = Annotated[
    float | None,
    typer.Option(
        help="Overfit learning rate, used as is and never searched (default: step 1 at 1e-3 with an adapter, "
        "1e-4 for full fine-tuning; if that does not memorise the examples and steps 2-3 pass, step 4 searches "
        "the LR: an LR range test, then runs at the LRs it suggests)."
    ),
]

# `hf-sanity run -- CMD` and `hf-sanity preflight -- CMD` (their block is below, before main).
# Everything from CMD on is the command's, its options included: hf-sanity's options go before it.
LAUNCH_CONTEXT = {"allow_interspersed_args": False}
CommandArg = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="-- CMD ...",
        help="Your training command, run unchanged: trl sft ..., accelerate launch / torchrun train.py, python "
        "train.py, a framework's CLI.",
    ),
]


# -- options of one command each, named here so that a command's signature reads as a list of its flags --------
OptionalModelOpt = Annotated[
    str | None, typer.Option(help="Model folder or hub id (its tokenizer is used unless --tokenizer).")
]
OptionalDatasetOpt = Annotated[
    str | None, typer.Option(help="JSON/JSONL/CSV/Parquet file, save_to_disk folder, or hub id.")
]
InspectSplitOpt = Annotated[str, typer.Option(help="Dataset split to inspect.")]
EvalDatasetOpt = Annotated[str | None, typer.Option(help="Eval dataset (for split-leakage).")]
EvalSplitOpt = Annotated[str | None, typer.Option(help="Eval split of --dataset (for split-leakage).")]
FixEvalDatasetOpt = Annotated[str | None, typer.Option(help="Eval dataset (split-leakage).")]
FixEvalSplitOpt = Annotated[str | None, typer.Option(help="Eval split of --dataset (split-leakage).")]
RowsOutOpt = Annotated[
    Path | None,
    typer.Option(
        help="Also write every offending row index per rule as JSON {rule: [rows]}, for dataset.filter "
        "(the report lists the first ten); split-leakage's rows index the eval split."
    ),
]
ShowOpt = Annotated[
    int | None,
    typer.Option(
        "--show",
        help="Also show the first N rows decoded, as the model is fed them (every token with its id, "
        "attention, position id, label and loss); see `hf-sanity show`.",
    ),
]
FixOpt = Annotated[
    bool,
    typer.Option(
        "--fix",
        help="Then apply the findings' remedies to a copy written to --fix-out and run the checks on the copy "
        "(see `hf-sanity fix`).",
    ),
]
FixOutOpt = Annotated[Path | None, typer.Option(help="With --fix: a new folder for the repaired copy.")]
ShowRowsOpt = Annotated[
    str | None, typer.Option(help="Rows of the dataset to show: 0,5 or 0-3 (default: 0,1).")
]
TrainerBatchOpt = Annotated[
    bool,
    typer.Option(
        "--trainer-batch",
        help="Build TRL's SFTTrainer on the model and the rows and show its batch (after its own "
        "tokenization and collator); needs the model's weights and trl.",
    ),
]
FixFolderOpt = Annotated[
    Path | None,
    typer.Option(
        help="A new folder for the repaired copy: a complete model folder (unchanged files hard-linked to "
        "yours), the data in its own format when it changed (dataset.jsonl, dataset.parquet, ...), and "
        "fixes.json / fixes.md. Not inside your model or data folders."
    ),
]
DiffOpt = Annotated[bool, typer.Option("--diff", help="Print the changes (and check them) without writing.")]
FixJsonOpt = Annotated[
    Path | None, typer.Option("--json", help="Also write what changed and the outcomes as JSON.")
]
PromptsOpt = Annotated[
    str,
    typer.Option(
        help="Held-out prompts: conversations (their last answer is the reference), prompt/completion or "
        "prompt-only rows, Alpaca rows (JSON/JSONL/CSV/Parquet file, save_to_disk folder, or hub id)."
    ),
]
AppliedAdapterOpt = Annotated[
    str | None, typer.Option(help="A saved PEFT adapter folder, applied to --model for the run.")
]
ComparedBaseOpt = Annotated[
    str | None,
    typer.Option(help="The base model (folder or hub id): its outputs are compared (adapter-no-effect)."),
]
ServedTokenizerOpt = Annotated[
    str | None,
    typer.Option(
        help="The tokenizer you serve with: its chat template renders the prompts (default: --tokenizer)."
    ),
]
HeldOutSplitOpt = Annotated[
    str | None,
    typer.Option(help="Dataset split (default: test, else validation; a single file is its split)."),
]
PromptCountOpt = Annotated[int, typer.Option("--n", help="Prompts to generate for.")]
MaxNewTokensOpt = Annotated[int, typer.Option(help="Tokens generated at most per prompt.")]
BatchSizeOpt = Annotated[int, typer.Option(help="Prompts per generate() call (left-padded).")]
SeedOpt = Annotated[int, typer.Option(help="Seed set before generating (generation is greedy).")]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Also draw the loss curve as a PNG.")]
ReproOpt = Annotated[
    Path | None,
    typer.Option(help="Folder for the single-batch reproduction (default: ./hf-sanity-repro/...)."),
]


# -- of doctor, served and run --------------------------------------------------------------------------------
StageOpt = Annotated[str | None, typer.Option(help="Only the rules of this stage.")]
SlugArg = Annotated[str, typer.Argument(help="A rule slug, e.g. prompt-in-loss.")]
RunsArg = Annotated[
    list[str],
    typer.Argument(
        metavar="RUN", help="Finished runs: trainer_state.json files, checkpoint folders or output_dirs."
    ),
]
PredictionsOpt = Annotated[
    Path | None,
    typer.Option(help='JSONL of {"prediction": ..., "label": ...} and/or {"score": ...} rows.'),
]
BaselineOpt = Annotated[
    float | None,
    typer.Option(help="An accuracy to judge the predictions against (0.9 for 90%): see --baseline-kind."),
]
BaselineKindOpt = Annotated[
    str,
    typer.Option(help="human (an accuracy above it is suspect: leakage) or majority (not above it is)."),
]
CurvesPlotOpt = Annotated[
    Path | None, typer.Option("--plot", help="Also draw the curves with the findings as a PNG.")
]
ServedModelOpt = Annotated[
    str, typer.Option(help="The served model: the merged model folder a server loads (or hub id).")
]
AdapterBaseOpt = Annotated[
    str, typer.Option(help="The base model the adapter was trained on (folder or hub id).")
]
TrainedAdapterOpt = Annotated[
    str, typer.Option(help="The trained PEFT adapter folder (save_pretrained's output).")
]
ProbeDatasetOpt = Annotated[
    str | None,
    typer.Option(help="Rows to compare the logits on (default: a few built-in conversations)."),
]
ServedModelTokenizerOpt = Annotated[
    str | None, typer.Option(help="Tokenizer folder or hub id (default: --model's).")
]
ProbeSampleOpt = Annotated[int, typer.Option(help="Examples to compare the logits on.")]
AbortOnOpt = Annotated[
    str,
    typer.Option(
        help="error: stop training after the step of the first finding of severity error (warnings and info "
        "never stop it); never: only report."
    ),
]
RunFolderOpt = Annotated[
    Path | None,
    typer.Option(
        "--report",
        help="Also write the run where `hf-sanity doctor DIR` reads it: DIR/trainer_state.json and "
        "DIR/hf-sanity/report.json (DIR/trainer-<i>/ for each of several trainers).",
    ),
]


# -- option blocks: the same options, in the same order, on several commands ------------------------------------
def protocol_setup(
    model: ModelOpt,
    dataset: DatasetOpt,
    tokenizer: TokenizerOpt = None,
    split: SplitOpt = "train",
    adapter_config: AdapterConfigOpt = None,
    lora_r: LoraROpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_target: LoraTargetOpt = None,
    n: ExamplesOpt = 8,
    steps: StepsOpt = 300,
    lr: LrOpt = None,
    max_len: MaxLenOpt = None,
    loss_on: LossOnOpt = "completion",
    format: FormatOpt = None,
    alpaca_template: AlpacaOpt = None,
) -> None:
    """overfit's and diagnose's pipeline (paths, adapter) and protocol (examples, steps, LR, encoding) options."""


def with_options(*blocks):
    """A command's options with shared blocks spliced in, in the order given: each block a function whose
    parameters are its options, ``None`` the command's own parameters (its ``**given`` collects the blocks')."""

    def splice(command):
        params = []
        for block in blocks:
            source = inspect.signature(command if block is None else block, eval_str=True)
            params += [
                p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                for p in source.parameters.values()
                if p.kind is not inspect.Parameter.VAR_KEYWORD
            ]
        command.__signature__ = inspect.Signature(params, return_annotation=None)
        return command

    return splice
