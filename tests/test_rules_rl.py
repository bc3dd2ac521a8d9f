"""RL fine-tuning before training: the rules of `hf_sanity/rules/rl.py` (and the RL parts of `template.py`,
`training/preference.py`'s reference-mismatch and `training/rl.py`'s config check), each planted through a real
`GRPOTrainer` or `RLOOTrainer` (`preflight(trainer=...)`) on the tiny model fine-tuned to answer the demo chats,
and the clean setups silent, with no SFT rule read into their prompts."""

from __future__ import annotations

import copy
import os
import random
import re
import sys
import threading
import time

import pytest
import torch
import trl_setups as setups
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_sanity
from hf_sanity.errors import UserInputError
from hf_sanity.measure import rl
from hf_sanity.testing import demo_rl_prompts


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model is overhead-bound: a second CPU thread only contends (a GRPO run is 10x slower with two on a
    shared 2-CPU machine). Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check(trainer, **kwargs):
    return hf_sanity.preflight(trainer=trainer, use_config=False, **kwargs)


def found(report, slug):
    return [f for f in report.findings if f.rule == slug]


def silent(report):
    assert [f"{f.rule}: {f.message}" for f in report.findings] == []


def rows(n=32, **kwargs):
    return demo_rl_prompts(n, seed=3, **kwargs)


# Reward functions as users write them (module-level: their source is what the dry run reads).
def contains_answer(completions, answer, **kwargs):
    """The conversational bug: `in` on a list of message dicts is always False."""
    return [1.0 if a.split()[-1].rstrip(".") in c else 0.0 for c, a in zip(completions, answer)]


def ends_turn(completions, **kwargs):
    """Looks for the end-of-turn token, which TRL's decode strips."""
    return [1.0 if "<|im_end|>" in setups.text_of(c) else 0.0 for c in completions]


def needs_solution(completions, solution, **kwargs):
    return [float(s in setups.text_of(c)) for c, s in zip(completions, solution)]


def raises(completions, **kwargs):
    raise ValueError("the grader is down")


def one_reward(completions, **kwargs):
    return [1.0]


def mostly_none(completions, **kwargs):
    return [None if i % 2 else 1.0 for i, _ in enumerate(completions)]


def constant(completions, **kwargs):
    return [0.5 for _ in completions]


def boxed_answer(completions, answer, **kwargs):
    """A correct but sparse reward: the final answer in \\boxed{}, as math graders want it (the model never writes
    it, nor do the dry run's completions built from the answers)."""
    return [
        float("\\boxed{" + a.split()[-1].rstrip(".") + "}" in setups.text_of(c))
        for c, a in zip(completions, answer)
    ]


def guarded_grader(completions, answer, **kwargs):
    """The same sparse reward as robust graders write it: the parse inside a try, 0 when it fails."""
    out = []
    for c, a in zip(completions, answer):
        try:
            boxed = re.search(r"\\boxed\{([^}]*)\}", c[0]["content"] if isinstance(c, list) else c)
            out.append(float(boxed is not None and boxed.group(1) == a.split()[-1].rstrip(".")))
        except Exception:
            out.append(0.0)
    return out


def even_length(completions, **kwargs):
    """A binary reward passing about half the completions."""
    return [float(len(setups.text_of(c)) % 2 == 0) for c in completions]


# -- reward-function-broken ------------------------------------------------------------------------------------
@pytest.mark.planted("reward-function-broken")
@pytest.mark.parametrize(
    ("func", "cause", "severity"),
    [
        (contains_answer, "completion-type", "error"),
        (ends_turn, "special-tokens-stripped", "error"),
        (needs_solution, "missing-column", "error"),
        (raises, "raises", "error"),
        (one_reward, "wrong-length", "error"),
        (mostly_none, "none-values", "error"),
        (constant, "constant", "error"),
    ],
)
def test_a_broken_reward_function_is_named_with_its_cause(tmp_path, func, cause, severity):
    report = check(setups.grpo(tmp_path, rows(), [func]))
    (finding,) = found(report, "reward-function-broken")
    assert (finding.evidence["cause"], finding.severity) == (cause, severity), finding.message
    assert finding.evidence["function"] == func.__name__
    assert report.stats["reward_dry_run"]["completions"] == {"synthetic": 16, "sampled": 16}


@pytest.mark.planted("reward-function-broken")
def test_a_constant_function_beside_one_that_varies_is_a_warning(tmp_path):
    report = check(setups.grpo(tmp_path, rows(), [setups.length_reward, constant]))
    (finding,) = found(report, "reward-function-broken")
    assert (finding.evidence["cause"], finding.severity) == ("constant", "warning")
    assert "length_reward still varies" in finding.message


@pytest.mark.planted("reward-function-broken")
def test_a_column_removed_by_remove_unused_columns_is_missing(tmp_path):
    report = check(setups.grpo(tmp_path, rows(), [setups.answer_reward], remove_unused_columns=True))
    (finding,) = found(report, "reward-function-broken")
    assert finding.evidence["cause"] == "missing-column"
    assert "remove_unused_columns=True removes it" in finding.evidence["why"]


def test_the_dry_run_is_safe(tmp_path):
    """Copies in, a time limit, the model and the RNG untouched; a slow function is not judged (a warning)."""

    def mutates(prompts, completions, **kwargs):
        prompts[0].clear()  # the user's rows must not change
        completions.clear()
        return []

    def slow(completions, **kwargs):
        time.sleep(3)
        return [0.0 for _ in completions]

    trainer = setups.grpo(tmp_path, rows(), [setups.length_reward, mutates])
    before = copy.deepcopy(trainer.train_dataset[0])
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.model.train()
    torch.manual_seed(7)
    random.seed(7)
    expected = (torch.rand(1).item(), random.random())
    torch.manual_seed(7)
    random.seed(7)
    report = check(trainer)
    assert (torch.rand(1).item(), random.random()) == expected
    assert trainer.train_dataset[0] == before and trainer.model.training
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in weights.items())
    (finding,) = found(report, "reward-function-broken")
    assert finding.evidence["function"] == "mutates" and finding.evidence["cause"] == "wrong-length"

    slow_trainer = setups.grpo(tmp_path, rows(), [slow])
    started = time.perf_counter()
    run = rl.dry_run(slow_trainer, [rl.synthetic(slow_trainer)], timeout=0.5)
    assert time.perf_counter() - started < 2.5
    assert run.checks[0].cause == "timeout" and run.checks[0].calls["synthetic"].timed_out


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the state of the processes")
def test_a_reward_function_that_outlives_its_time_limit_is_stopped(tmp_path, monkeypatch):
    """Killed at the deadline with what it started: nothing keeps running (or billing) beside the trainer, and the
    report says it was not judged."""
    import subprocess

    pids = tmp_path / "pids"

    def hangs(completions, **kwargs):
        started = subprocess.Popen(["sleep", "60"])  # a helper process of its own, as a sandbox or server
        pids.write_text(f"{os.getpid()} {started.pid}")
        time.sleep(60)
        return [0.0 for _ in completions]

    monkeypatch.setattr(rl, "REWARD_TIMEOUT", 1.0)
    started = time.perf_counter()
    report = check(setups.grpo(tmp_path, rows(), [hangs]))
    assert time.perf_counter() - started < 30
    (finding,) = found(report, "reward-function-broken")
    assert (finding.evidence["cause"], finding.severity) == ("timeout", "warning")
    assert "did not return within 1 s: not judged" in finding.evidence["why"]
    assert report.stats["reward_dry_run"]["functions"]["hangs"]["cause"] == "timeout"
    child, helper = map(int, pids.read_text().split())
    assert child != os.getpid() and not running(child) and not running(helper)
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)  # reaped by the dry run: not even a zombie of ours
    assert not [t for t in threading.enumerate() if "reward" in t.name]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one the system has yet to reap is not running)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_what_a_reward_function_returns_comes_back_from_its_process():
    """Values are made plain in the child (numbers, None, or the type of what is not one); what it writes stays
    there; what ends its process is said, not raised."""
    import numpy as np

    kwargs = {"completions": ["a", "bb"], "answer": ["x", "y"]}
    counter = {"calls": 0}

    def writes(completions, answer, **kwargs):
        counter["calls"] += 1
        answer.clear()
        return (float(len(c)) for c in completions)  # a generator

    assert rl.call_reward(writes, kwargs).values == [1.0, 2.0]
    assert kwargs["answer"] == ["x", "y"] and counter["calls"] == 0  # its writes stayed in the child
    scalars = rl.call_reward(lambda completions, **k: [np.float32(1.5), torch.tensor(2.0)], kwargs)
    assert scalars.values == [1.5, 2.0]
    odd = rl.call_reward(lambda completions, **k: [lambda: 1.0, None], kwargs)  # a lambda cannot be pickled
    assert odd.error is None and odd.values[0] == rl.NotANumber("function") and odd.values[1] is None
    assert rl.call_reward(raises, kwargs).error == "ValueError: the grader is down"
    assert rl.call_reward(lambda completions, **k: sys.exit(3), kwargs).error == "SystemExit: 3"
    ended = rl.call_reward(lambda completions, **k: os._exit(3), kwargs)
    assert ended.values is None and "ended its process (exit status 3)" in ended.skipped


def returns_a_function(completions, **kwargs):
    return [len for _ in completions]


@pytest.mark.planted("reward-function-broken")
def test_a_reward_that_returns_what_is_not_a_number(tmp_path):
    (finding,) = found(check(setups.grpo(tmp_path, rows(), [returns_a_function])), "reward-function-broken")
    assert finding.evidence["cause"] == "raises"
    assert "it returned a builtin_function_or_method, not a number" in finding.message


def test_reward_dry_run_false_calls_nothing_and_says_so(tmp_path):
    calls = []

    def counted(completions, **kwargs):
        calls.append(len(completions))
        return [0.0 for _ in completions]

    report = check(setups.grpo(tmp_path, rows(), [counted]), reward_dry_run=False)
    assert calls == [] and found(report, "reward-function-broken") == []
    assert report.stats["reward_dry_run"].startswith("skipped: reward_dry_run=False")


def test_the_completions_are_passed_as_trl_passes_them(tmp_path):
    """Messages for conversational prompts, strings for text ones, special tokens stripped, columns as keywords.
    Each call runs in a child process: what the spy saw comes back through a file."""
    import json

    seen = tmp_path / "seen.jsonl"

    def spy(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
        with seen.open("a") as out:
            out.write(json.dumps({"call": [prompts[0], completions[0], completion_ids[0], answer[0], sorted(kwargs)],
                                  "state": trainer_state is not None}) + "\n")  # fmt: skip
        return [float(len(setups.text_of(c))) for c in completions]

    def calls():
        return [json.loads(line) for line in seen.read_text().splitlines()]

    tok = AutoTokenizer.from_pretrained(setups.trained_folder())
    check(setups.grpo(tmp_path, rows(), [spy]))
    last = calls()[-1]  # the model's own completions
    prompt, completion, ids, answer, extra = last["call"]
    assert prompt[-1]["role"] == "user" and completion[0]["role"] == "assistant"
    assert completion[0]["content"] == tok.decode(ids, skip_special_tokens=True) and "<|im_end|>" not in str(
        completion
    )
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") and answer.endswith(".")
    assert {"log_extra", "log_metric"} <= set(extra) and last["state"]
    seen.unlink()
    check(setups.grpo(tmp_path, setups.rendered(rows(), tok), [spy]))
    assert isinstance(calls()[-1]["call"][1], str)


@pytest.mark.clean(
    "reward-function-broken",
    "completions-truncated",
    "group-too-small",
    "stop-token-mismatch",
    "length-runaway",
)  # fmt: skip  (beta=0: no reference model to compare)
@pytest.mark.parametrize(("conversational", "seed"), [(True, 0), (True, 1), (False, 0), (False, 2)])
def test_clean_grpo_setups_are_silent(tmp_path, conversational, seed):
    data = rows() if conversational else setups.rendered(rows())
    report = check(setups.grpo(tmp_path, data, [setups.length_reward, setups.answer_reward], seed=seed))
    silent(report)
    assert report.stats["objective"] == "rl" and report.stats["sampled_completions"]["clipped_share"] == 0.0
    assert set(report.stats["reward_dry_run"]["functions"]) == {"length_reward", "answer_reward"}


@pytest.mark.clean(
    "reward-function-broken", "completions-truncated", "stop-token-mismatch", "reference-mismatch"
)
def test_clean_rloo_with_a_graded_reward_is_silent(tmp_path):
    silent(check(setups.rloo(tmp_path, rows(), [setups.length_reward])))


# -- completions-truncated ---------------------------------------------------------------------------------------
@pytest.mark.planted("completions-truncated")
def test_completions_cut_by_a_short_budget(tmp_path):
    report = check(setups.grpo(tmp_path, rows(), [setups.length_reward], max_completion_length=4))
    (finding,) = found(report, "completions-truncated")
    assert finding.evidence["cause"] == "budget" and finding.severity == "error"
    assert finding.evidence["clipped_share"] == 1.0 and finding.evidence["max_completion_length"] == 4
    # Continued past the cap, the answers end: the fix names the length they need.
    assert finding.evidence["continued_ended"] == finding.evidence["continued"] == 8
    needed = max(finding.evidence["continued_lengths"])
    assert 4 < needed <= 16 and f"`max_completion_length` to at least {needed}" in finding.fix
    assert found(report, "group-too-small") == []  # truncated completions say nothing of a pass rate


def base_model_stops():
    """A model folder as a base model ships it: EOS is <|endoftext|>, the chat template ends turns with <|im_end|>."""
    tok = AutoTokenizer.from_pretrained(setups.trained_folder())
    tok.eos_token = "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(setups.trained_folder())
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


@pytest.mark.planted("completions-truncated", "stop-token-mismatch")
def test_completions_run_past_an_end_of_turn_the_trainer_does_not_stop_on(tmp_path):
    model, tok = base_model_stops()
    report = check(setups.grpo(tmp_path, rows(), [setups.length_reward], model=model, tok=tok))
    (truncated,) = found(report, "completions-truncated")
    assert truncated.evidence["cause"] == "stop-token-mismatch", truncated.message
    (stop,) = found(report, "stop-token-mismatch")
    assert stop.evidence["end_of_turn"] == "<|im_end|>" and stop.evidence["stop_tokens"] == ["<|endoftext|>"]
    assert "GRPOTrainer stops its completions only on" in stop.message


def ends_turns_with_end(special: bool, writes: bool = True):
    """The fine-tuned model with its template's end of turn renamed: assistant turns end with a new `<|end|>` (a
    special token, or a plain added one that decoding keeps), which the model writes where it wrote <|im_end|>
    (its embedding and output rows copied, <|im_end|>'s output row negated; with ``writes=False`` the new row is
    left as initialised: it never writes it); EOS is a new `</s>`, the only id the generation config stops on."""
    tok = AutoTokenizer.from_pretrained(setups.trained_folder())
    if special:
        tok.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    else:
        tok.add_tokens(["<|end|>"])
    tok.add_special_tokens({"eos_token": "</s>"})
    tok.chat_template = tok.chat_template.replace("<|im_end|>", "<|end|>")
    model = AutoModelForCausalLM.from_pretrained(setups.trained_folder())
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    end, im_end = tok.convert_tokens_to_ids(["<|end|>", "<|im_end|>"])
    with torch.no_grad():
        for weights in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)[
            : 2 * writes
        ]:
            weights[end] = weights[im_end]
        if writes:
            model.get_output_embeddings().weight[im_end] *= -1
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


@pytest.mark.planted("stop-token-mismatch", "completions-truncated")
@pytest.mark.parametrize(
    ("special", "writes"),
    [(True, True), (False, True), (True, False)],
    ids=["special", "plain-token", "unwritten"],
)
def test_an_end_of_turn_the_trainer_does_not_stop_on_is_named_not_the_cap(tmp_path, special, writes):
    """The template ends turns with `<|end|>`, generation stops on `</s>`: the completions write `<|end|>` and run
    on to the cap (or, from a model not yet taught it, never write it). Whether decoding strips `<|end|>`
    (special) or keeps it, the rule reads the ids; the cap is not the cause either way."""
    model, tok = ends_turns_with_end(special, writes)
    trainer = setups.grpo(tmp_path, rows(), [setups.length_reward], model=model, tok=tok)
    end = tok.convert_tokens_to_ids("<|end|>")
    assert trls_stop_ids(trainer) == [tok.eos_token_id] and end not in trls_stop_ids(trainer)
    report = check(trainer, select=["stop-token-mismatch", "completions-truncated"])
    (stop,) = found(report, "stop-token-mismatch")
    assert (stop.evidence["end_of_turn"], stop.evidence["end_of_turn_id"], stop.evidence["stop_tokens"]) == (
        "<|end|>", end, ["</s>"]
    )  # fmt: skip
    (truncated,) = found(report, "completions-truncated")
    assert truncated.evidence["cause"] == "stop-token-mismatch", truncated.message
    written = truncated.evidence["end_of_turn_written"]
    assert truncated.evidence["end_of_turn"] == "<|end|>" and (written >= 8 if writes else written == 0)
    assert "<|end|>" in truncated.message and "eos_token_id" in truncated.fix


def trl_version() -> str:
    import trl

    return trl.__version__


def trls_stop_ids(trainer) -> list[int]:
    """The ids TRL's own generation stops on: ``eos_token_ids`` (TRL 1.16: the model's generation config's EOS
    ids and the tokenizer's), or the generation config it builds (TRL 1.9: the tokenizer's EOS alone)."""
    listed = getattr(trainer, "eos_token_ids", None)
    if listed is None:
        listed = trainer.generation_config.eos_token_id
    return [listed] if isinstance(listed, int) else list(listed)


@pytest.mark.clean("stop-token-mismatch", "completions-truncated")
def test_the_same_end_of_turn_among_the_stop_ids_ends_the_completions(tmp_path):
    model, tok = ends_turns_with_end(True)
    end = tok.convert_tokens_to_ids("<|end|>")
    model.generation_config.eos_token_id = [tok.eos_token_id, end]
    trainer = setups.grpo(tmp_path, rows(), [setups.length_reward], model=model, tok=tok)
    if end not in trls_stop_ids(trainer):  # TRL 1.9 stops on the tokenizer's EOS alone: not clean there
        pytest.skip(f"TRL {trl_version()} does not stop on the model's generation config's EOS ids")
    report = check(trainer, select=["stop-token-mismatch", "completions-truncated"])
    silent(report)
    assert report.stats["sampled_completions"]["clipped_share"] == 0.0


@pytest.mark.planted("completions-truncated")
def test_a_policy_that_never_ends_its_completions_is_not_blamed_on_the_cap(tmp_path):
    """The random tiny model writes random tokens: continued to 4x the cap its completions still do not end."""
    model = AutoModelForCausalLM.from_pretrained(setups.folder())
    report = check(setups.grpo(tmp_path, rows(), [setups.length_reward], model=model, tok=setups.tokenizer()),
                   select="completions-truncated")  # fmt: skip
    (truncated,) = found(report, "completions-truncated")
    evidence = truncated.evidence
    assert evidence["cause"] == "no-end-of-turn", truncated.message
    assert (
        evidence["continued"] == 8 and 2 * evidence["continued_ended"] < 8 and evidence["continued_to"] == 96
    )
    assert "a longer cap would not help" in truncated.fix and "max_completion_length" not in truncated.fix


# -- group-too-small ----------------------------------------------------------------------------------------------
@pytest.mark.planted("group-too-small")
def test_rloo_default_groups_of_two_with_a_binary_reward(tmp_path):
    report = check(setups.rloo(tmp_path, rows(), [even_length]))
    (finding,) = found(report, "group-too-small")
    assert finding.evidence["group_size"] == 2 and finding.evidence["expected_uninformative"] >= 0.5
    assert 0 < finding.evidence["pass_rate"] < 1 and finding.evidence["cause"] == "binary-reward"
    needed = finding.evidence["group_size_for_signal"]
    assert needed > 2 and 1 - rl.uninformative_share(finding.evidence["pass_rate"], needed) > 0.5
    assert f"G={needed} would give more than half of them a spread" in finding.message


@pytest.mark.planted("group-too-small")
@pytest.mark.clean("reward-function-broken")
@pytest.mark.parametrize("func", [boxed_answer, guarded_grader])
def test_a_sparse_reward_at_rloo_default_groups_is_too_small_not_broken(tmp_path, func):
    """It gave 0 to every completion it was given (24): not constant by construction, since it reads them. What is
    wrong is the group: at RLOO's G=2 a reward that almost never passes almost never varies within a group."""
    report = check(setups.rloo(tmp_path, rows(), [func]))
    assert found(report, "reward-function-broken") == []
    verdict = report.stats["reward_dry_run"]["functions"][func.__name__]
    assert (
        verdict["sparse"]
        and verdict["reads_completions"]
        and verdict["values"] == [0.0]
        and not verdict["cause"]
    )
    (small,) = found(report, "group-too-small")
    evidence = small.evidence
    assert (evidence["cause"], evidence["group_size"], evidence["passed"], evidence["pass_rate"]) == (
        "sparse-reward", 2, 0, 0.0
    )  # fmt: skip
    assert evidence["expected_uninformative"] == 1.0
    assert (
        evidence["completions"] == 2 * 4 + 8 * 8
    )  # the model's group of 2 for 4 prompts, then 8 prompts x 8
    assert evidence["pass_rate_bound"] < 0.05 and evidence["group_size_for_signal_at_bound"] == 17
    assert "G=17" in small.message and "(to 17 or more)" in small.fix


@pytest.mark.planted("reward-function-broken")
def test_a_constant_reward_is_told_from_a_sparse_one_by_what_it_reads(tmp_path):
    """The sparse reward's twin: one value everywhere, and it never looks at a completion."""
    report = check(setups.rloo(tmp_path, rows(), [constant]))
    (broken,) = found(report, "reward-function-broken")
    assert (broken.evidence["cause"], broken.severity, broken.evidence["reads_completions"]) == (
        "constant", "error", False
    )  # fmt: skip
    assert "does not read them" in broken.evidence["why"]
    assert found(report, "group-too-small") == []  # not a pass rate: a bug


@pytest.mark.clean("group-too-small")
def test_groups_of_eight_for_a_binary_reward_are_enough(tmp_path):
    report = check(
        setups.grpo(tmp_path, rows(), [even_length], num_generations=8, per_device_train_batch_size=8)
    )
    assert found(report, "group-too-small") == [] and found(report, "reward-function-broken") == []


# -- reference-mismatch (beta > 0) and length-runaway (loss_type) ------------------------------------------------------
def changed_after_loading():
    """The fine-tuned model as loaded, then changed in memory (TRL reloads the reference from its path)."""
    model = AutoModelForCausalLM.from_pretrained(setups.trained_folder())
    with torch.no_grad():
        torch.manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.planted("reference-mismatch")
def test_grpo_with_beta_reloads_its_reference_from_the_path(tmp_path):
    model = changed_after_loading()
    report = check(setups.grpo(tmp_path, rows(), [setups.length_reward], model=model, beta=0.04))
    (finding,) = found(report, "reference-mismatch")
    assert finding.evidence["cause"] == "reloaded-from-path" and finding.severity == "warning"


@pytest.mark.planted("length-runaway")
def test_the_length_biased_grpo_loss_is_a_config_warning(tmp_path):
    report = check(setups.grpo(tmp_path, rows(), [setups.length_reward], loss_type="grpo"))
    (finding,) = found(report, "length-runaway")
    assert finding.evidence["loss_type"] == ["grpo"] and finding.severity == "warning"


# -- after training: the held-out reward (policy-drift, cause reward-drop) ------------------------------------------
def logged_rewards(*values):
    """A run's log history as Trainer keeps it (``trainer.state.log_history``)."""
    return [{"step": i + 1, "loss": 0.0, "reward": v} for i, v in enumerate(values)]


@pytest.mark.planted("policy-drift")
def test_a_held_out_reward_far_below_the_last_training_steps(tmp_path):
    """A policy that games its training prompts: the log's last rewards are 0.9, the same reward function on the
    held-out prompts' answers (a model that repeats one word) gives ~0."""
    import datasets

    from hf_sanity.testing import trained_setup

    tuned, tok = trained_setup("undertrained")
    held_out = datasets.Dataset.from_list(rows(16))
    report = hf_sanity.outputs(model=tuned, tokenizer=tok, dataset=held_out, objective="rl", n=8, max_new_tokens=24,
                               reward_funcs=[setups.answer_reward], train_reward=logged_rewards(0.2, 0.5, 0.9),
                               select="policy-drift", use_config=False)  # fmt: skip
    (drift,) = found(report, "policy-drift")
    assert drift.evidence["causes"] == ["reward-drop"] and drift.evidence["rewards"]["train"] == 0.9
    assert drift.evidence["rewards"]["held_out"] < 0.8 and report.stats["rewards"]["completions"] == 8


@pytest.mark.clean("policy-drift")
def test_a_held_out_reward_that_holds_is_silent(tmp_path):
    import json

    import datasets

    from hf_sanity.testing import trained_setup

    model, tok = trained_setup("clean")
    base = AutoModelForCausalLM.from_pretrained(setups.trained_folder())
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainer_state.json").write_text(
        json.dumps({"log_history": logged_rewards(0.5, 0.8, 0.85)})
    )
    report = hf_sanity.outputs(model=model, tokenizer=tok, dataset=datasets.Dataset.from_list(rows(16)), base=base,
                               objective="rl", n=8, max_new_tokens=24, reward_funcs=[setups.answer_reward],
                               train_reward=tmp_path / "run", use_config=False)  # fmt: skip
    silent(report)
    assert report.stats["rewards"]["train"] == 0.85 and report.stats["rewards"]["held_out"] >= 0.75
    with pytest.raises(UserInputError, match="cannot read the training reward"):
        rl.training_reward(tmp_path / "missing.json")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the state of the processes")
def test_a_reward_call_returns_without_waiting_for_its_process_to_end_and_its_child_is_reaped():
    """The result is read as soon as the child sends it (its exit, the teardown of a copy of the trainer's process,
    is not waited for); the exited child is reaped later, by the next call or reap_finished: none is left."""
    from hf_sanity.measure import user_code

    pids = []

    def tells_its_pid(completions, **kwargs):
        pids.append(os.getpid())  # in the child: the list is its own copy
        return [float(os.getpid()) for _ in completions]

    call = rl.call_reward(tells_its_pid, {"completions": ["a"]})
    (child,) = {int(v) for v in call.values}
    assert child != os.getpid() and pids == []
    assert user_code.reap_finished(block=True) == 0
    assert not running(child)
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)  # reaped: not even a zombie of ours
