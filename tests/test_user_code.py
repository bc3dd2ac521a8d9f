"""The user's code called in ONE forked child for many calls (`measure/user_code.run_in_one_child`, the reward dry
run): each call under its own time limit there, the parent's backstop for a call stuck where that limit cannot
reach, the parent's state untouched bit for bit, and every reward function judged in that one child with the
causes preflight reports."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import trl_setups as setups
from test_rules_rl import one_thread, running  # noqa: F401 - one_thread is autouse

import hf_sanity
from hf_sanity.measure import rl, user_code

pytestmark = pytest.mark.skipif(not user_code.can_isolate(), reason="calls the user's code in a forked child")


def reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def called(func, timeout=5.0):
    """A step that calls ``func`` as the dry run calls the user's code, and says where it ran."""
    return lambda: (os.getpid(), user_code.run_isolated(func, timeout))


# -- the machinery ----------------------------------------------------------------------------------------------
def test_every_step_runs_in_one_child_and_each_call_has_its_own_time_limit():
    """A call that hangs (in Python: a sleep) is stopped by its own timer at its limit; the steps after it still
    run, in the same child; what a call raises is its error; the caller waits for none of the limits but the one."""

    def grader_down():
        raise ValueError("the grader is down")

    started = time.perf_counter()
    outcomes = user_code.run_in_one_child(
        [called(lambda: 1.5), called(lambda: time.sleep(60), timeout=0.5), called(grader_down)], timeout=5.0
    )
    assert time.perf_counter() - started < 5
    pids = {o.value[0] for o in outcomes}
    (child,) = pids
    assert child != os.getpid()
    fine, hung, broken = (o.value[1] for o in outcomes)
    assert (fine.value, fine.error, fine.timed_out) == (1.5, None, False)
    assert (hung.timed_out, hung.error) == (True, "did not return within 0.5 s")
    assert (broken.error, broken.timed_out) == ("ValueError: the grader is down", False)
    assert user_code.reap_finished(block=True) == 0 and not running(child)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the state of the processes")
def test_a_call_stuck_where_its_timer_cannot_stop_it_is_killed_with_what_it_started(tmp_path):
    """The backstop: a call deaf to its timer (as one stuck in C code is) is killed by the parent at its limit and
    GRACE, with the process it started; its step is timed out, the steps after it are not run, the one before keeps
    its result; the child is reaped before the caller goes on."""
    pids = tmp_path / "pids"

    def deaf():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # no handler runs, as in a C loop
        helper = subprocess.Popen(["sleep", "60"])
        pids.write_text(f"{os.getpid()} {helper.pid}")
        time.sleep(60)

    started = time.perf_counter()
    before, stuck, after = user_code.run_in_one_child(
        [called(lambda: "judged"), called(deaf, timeout=0.5), called(lambda: "never")], timeout=5.0
    )
    took = time.perf_counter() - started
    assert 0.5 + user_code.GRACE <= took < 0.5 + user_code.GRACE + 3
    assert before.value[1].value == "judged"
    assert stuck.timed_out and stuck.error == "did not return within 0.5 s"
    assert after.skipped == user_code.NOT_RUN and after.value is None
    child, helper = map(int, pids.read_text().split())
    assert reaped(child) and not running(child) and not running(helper)


def test_a_call_that_ends_its_process_is_said_and_the_rest_not_run():
    ended, after = user_code.run_in_one_child([called(lambda: os._exit(3)), called(lambda: 1)], timeout=5.0)
    assert ended.value is None and "ended its process (exit status 3)" in ended.skipped
    assert after.skipped == user_code.NOT_RUN


# Module state a call writes to: in the parent it must stay as it was.
SEEN: list[str] = []


def test_what_the_calls_draw_and_write_stays_in_the_child():
    """Each call draws from Python's, NumPy's and torch's generators and writes to its arguments and to module
    state: in the parent the RNG states are bit for bit the same, the arguments and the module state unchanged."""
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    expected = (torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy())
    prompts = [["the", "rows"], ["as", "given"]]

    def draws_and_writes(rows):
        SEEN.append("called")
        rows[0].clear()
        return random.random() + float(np.random.rand()) + float(torch.rand(()))

    outcomes = user_code.run_in_one_child([called(lambda: draws_and_writes(prompts))] * 3, timeout=5.0)
    values = [o.value[1].value for o in outcomes]
    assert all(isinstance(v, float) for v in values) and len(set(values)) == 3  # each call drew anew
    assert torch.equal(torch.get_rng_state(), expected[0])
    assert random.getstate() == expected[1] and np.array_equal(np.random.get_state()[1], expected[2])
    assert prompts == [["the", "rows"], ["as", "given"]] and SEEN == []


# -- the reward dry run in one child ------------------------------------------------------------------------------
# Where each reward function ran: a file named before the fork (the child inherits the name).
PIDS = {"file": None}


def noted(name: str) -> None:
    with open(PIDS["file"], "a") as out:
        out.write(f"{name} {os.getpid()}\n")


def graded(completions, **kwargs):
    noted("graded")
    return setups.length_reward(completions)


def grader_down(completions, **kwargs):
    noted("grader_down")
    raise ValueError("the grader is down")


def hangs(completions, **kwargs):
    noted("hangs")
    time.sleep(60)


def contains_answer(completions, answer, **kwargs):
    """The conversational bug: `in` on a list of message dicts is always False (a second call, as strings, tells)."""
    noted("contains_answer")
    return [1.0 if a.split()[-1].rstrip(".") in c else 0.0 for c, a in zip(completions, answer)]


def half(completions, **kwargs):
    noted("half")
    return [0.5 for _ in completions]


def verdicts(run) -> dict[str, tuple]:
    return {c.name: (c.cause, c.skipped) for c in run.checks}


def test_the_dry_run_judges_every_reward_function_in_one_child(tmp_path):
    """Five functions (one clean, one raising, one hanging, one that needs the follow-up call as strings, one
    constant that never reads its completions): each judged with its cause, every call made in the same child."""
    PIDS["file"] = tmp_path / "pids"
    trainer = setups.grpo(tmp_path, rows(), [graded, grader_down, hangs, contains_answer, half])
    started = time.perf_counter()
    run = rl.dry_run(trainer, [rl.synthetic(trainer)], timeout=1.0)
    assert time.perf_counter() - started < 1.0 + user_code.GRACE
    assert verdicts(run) == {
        "graded": (None, None),
        "grader_down": ("raises", None),
        "hangs": ("timeout", None),
        "contains_answer": ("completion-type", None),
        "half": ("constant", None),
    }
    by_name = {c.name: c for c in run.checks}
    assert "ValueError: the grader is down" in by_name["grader_down"].why
    assert by_name["hangs"].calls["synthetic"].error == "did not return within 1 s"
    assert by_name["half"].reads_completions is False
    seen = [line.split() for line in PIDS["file"].read_text().splitlines()]
    assert {pid for _, pid in seen} != {str(os.getpid())} and len({pid for _, pid in seen}) == 1
    # The follow-up calls, decided from values in the child: contains_answer as messages then as strings; half
    # also as strings, then twice for the reads-completions probe (its completions, then ones that fail on use).
    assert [name for name, _ in seen].count("contains_answer") == 2
    assert [name for name, _ in seen].count("half") == 4


def deaf(completions, **kwargs):
    noted("deaf")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)


def test_a_reward_function_stuck_past_its_timer_is_timed_out_and_the_rest_said_not_called(tmp_path):
    PIDS["file"] = tmp_path / "pids"
    trainer = setups.grpo(tmp_path, rows(), [graded, deaf, half])
    run = rl.dry_run(trainer, [rl.synthetic(trainer)], timeout=0.5)
    checks = {c.name: c for c in run.checks}
    assert checks["graded"].cause is None and checks["deaf"].cause == "timeout"
    assert "did not return within 0.5 s" in checks["deaf"].why
    assert checks["half"].skipped == user_code.NOT_RUN and checks["half"].cause is None
    assert run.skipped == [f"half: {user_code.NOT_RUN}"]
    assert "half" not in PIDS["file"].read_text()


@pytest.mark.planted("reward-function-broken")
def test_preflight_names_the_broken_function_beside_clean_ones_and_the_clean_ones_stay_silent(tmp_path):
    """Through preflight (both the dry run's and the model's completions, all in one child): the raising function
    is the finding, with its error; the clean functions beside it are not named."""
    PIDS["file"] = tmp_path / "pids"
    report = hf_sanity.preflight(
        trainer=setups.grpo(tmp_path, rows(), [graded, grader_down]), use_config=False
    )
    (finding,) = [f for f in report.findings if f.rule == "reward-function-broken"]
    assert finding.evidence["function"] == "grader_down" and finding.evidence["cause"] == "raises"
    assert "ValueError: the grader is down" in finding.message
    assert report.stats["reward_dry_run"]["functions"]["graded"]["cause"] is None

    clean = hf_sanity.preflight(trainer=setups.grpo(tmp_path / "clean", rows(), [graded]), use_config=False)
    assert [f.rule for f in clean.findings if f.rule == "reward-function-broken"] == []


def rows(n=32):
    from hf_sanity.testing import demo_rl_prompts

    return demo_rl_prompts(n, seed=3)


# -- the callback: the dry run's child works beside the first step -------------------------------------------------
def watch(**kwargs):
    return hf_sanity.SanityCallback(use_config=False, print_findings=False, check_every=1, **kwargs)


MAIN = {"pid": None}


def raises_in_the_run(completions, **kwargs):
    """Broken for every call, the dry run's and TRL's: the run dies in its first step."""
    raise ValueError("the grader is down")


def test_a_run_that_dies_in_its_first_step_still_reports_the_dry_runs_verdict(tmp_path):
    """The dry run started at train begin is read at the first step's end; a run that never gets there (TRL's own
    call raises in step 1) still has the verdict that explains it in its report."""
    cb = watch(abort_on="error")
    trainer = setups.grpo(tmp_path, rows(), [raises_in_the_run], callbacks=[cb], max_steps=2)
    with pytest.raises(ValueError, match="the grader is down"):
        trainer.train()
    (broken,) = [f for f in cb.report.findings if f.rule == "reward-function-broken"]
    assert broken.step == 0 and broken.evidence["cause"] == "raises"
    assert cb.report.stats["reward_dry_run"]["functions"]["raises_in_the_run"]["cause"] == "raises"


def hangs_in_the_dry_run_interrupts_the_run(completions, **kwargs):
    if os.getpid() != MAIN["pid"]:  # the dry run's child: hangs
        with open(PIDS["file"], "w") as out:
            out.write(str(os.getpid()))
        time.sleep(60)
    for _ in range(500):  # TRL's call in the run, once the dry run's is under way: the user presses Ctrl-C
        if PIDS["file"].exists():
            break
        time.sleep(0.01)
    raise KeyboardInterrupt


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the state of the processes")
def test_an_interrupted_run_does_not_wait_for_the_dry_run_and_leaves_no_process(tmp_path):
    """Ctrl-C in the first step while the dry run's call still runs: the run stops at once (not at the call's
    limit), the child is killed and reaped, the report says the dry run gave no verdict."""
    MAIN["pid"], PIDS["file"] = os.getpid(), tmp_path / "pid"
    cb = watch()
    trainer = setups.grpo(
        tmp_path, rows(), [hangs_in_the_dry_run_interrupts_the_run], callbacks=[cb], max_steps=2
    )
    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert time.perf_counter() - started < rl.REWARD_TIMEOUT / 2
    assert cb.report.stats["reward_dry_run"].startswith("skipped: the run was interrupted")
    child = int(PIDS["file"].read_text())
    assert reaped(child) and not running(child)
