"""Calling the user's own code (an RL run's reward functions) so that it changes nothing and can be abandoned.

A reward function may draw random numbers, write to its arguments, call a paid service or hang. hf-sanity calls
it before training (the reward dry run) and after it (the held-out reward) as TRL will, and the run must go on
bit for bit as it would have without those calls. So each call runs in a forked child process (POSIX):

* the child works on a copy of the process: whatever it draws from Python's, NumPy's or torch's random
  generators, whatever it writes to its arguments or to module state, stays there; the parent's RNG states are
  also restored around the call (:func:`hf_sanity.untouched.preserved_rng`), for what the fork itself may do;
* at the deadline the child (and the process group it leads: anything it started) is killed and reaped: nothing
  keeps running beside the trainer, nothing is billed after the report says "timed out";
* the result comes back through a pipe as plain data: the caller's ``call`` converts what the user's code
  returned before it is pickled (a value that cannot be sent back is reported, not raised);
* what a fork inherits and what it does not: memory (copy-on-write, so the model's weights cost nothing), file
  descriptors (an HTTP client's pooled connection is shared: the child may leave it unusable, and the client
  opens a new one), only the calling thread (the child sets torch to one intra-op thread and tokenizers'
  parallelism off, the pools a fork leaves behind); a CUDA context is not usable in the child (as in a forked
  DataLoader worker): a call that needs CUDA is reported as not judged, with that reason, never as broken.

Where ``os.fork`` does not exist (Windows) nothing is called: the outcome says why (a thread that outlives its
deadline cannot be stopped, and it would keep running beside the trainer).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# torch's message when a forked child touches CUDA the parent initialised.
CUDA_IN_FORK = "Cannot re-initialize CUDA in forked subprocess"
NO_FORK = "this platform has no os.fork: a call that outlives its time limit could not be stopped"


@dataclass(frozen=True)
class Outcome:
    """One call of user code in a child process."""

    value: Any = None  # what ``call`` returned (plain data)
    error: str | None = None  # what the user's code raised: "TypeError: ..."
    timed_out: bool = False  # killed at the deadline
    # Why it was not judged: no fork here, it needs CUDA, its result could not be read.
    skipped: str | None = None
    seconds: float = 0.0


def can_isolate() -> bool:
    return hasattr(os, "fork") and os.name == "posix"


def run_isolated(call: Callable[[], Any], timeout: float) -> Outcome:
    """``call()`` in a forked child, at most ``timeout`` seconds; the parent's RNG states restored after."""
    from hf_sanity.untouched import preserved_rng

    if not can_isolate():
        return Outcome(skipped=NO_FORK)
    started = time.perf_counter()
    with preserved_rng():
        status, payload = _fork_and_wait(call, timeout)
    seconds = time.perf_counter() - started
    if status == "ok":
        return Outcome(value=payload, seconds=seconds)
    if status == "raised":
        if CUDA_IN_FORK in payload:
            return Outcome(skipped="it uses CUDA, which the dry run's forked process cannot: not judged",
                           seconds=seconds)  # fmt: skip
        return Outcome(error=payload, seconds=seconds)
    if status == "timeout":
        return Outcome(error=f"did not return within {timeout:g} s", timed_out=True, seconds=seconds)
    return Outcome(skipped=payload, seconds=seconds)  # "lost": the child died or its result was unreadable


def _fork_and_wait(call: Callable[[], Any], timeout: float) -> tuple[str, Any]:
    """(status, payload): ("ok", value), ("raised", "Type: message"), ("timeout", None) or ("lost", why)."""
    read_end, write_end = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # buffered output would be written twice, by both processes
        with contextlib.suppress(Exception):
            stream.flush()
    with _fork_environment():
        pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's stack
        try:
            os.close(read_end)
            _child(call, write_end)
        finally:
            os._exit(0)
    os.close(write_end)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also done by the child: whichever runs first, the group exists
    data, deadline = bytearray(), time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill(pid)
                return "timeout", None
            ready, _, _ = select.select([read_end], [], [], left)
            if not ready:
                continue
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
    try:
        result = pickle.loads(bytes(data))
    except Exception:
        result = None
    if result is not None:  # the child has sent its result and is exiting: its teardown is not waited for
        # Anything the call started and left behind (the group's id lives while it has members).
        _kill_group(pid)
        _UNREAPED.append(pid)
        reap_finished()
        return result
    _, status = os.waitpid(pid, 0)
    _kill_group(pid)
    code = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status
    return "lost", f"the call ended its process (exit status {code}) before it returned"


# Children that sent their result, whose exit is not waited for: tearing down a copy of a large process (a
# model's trainer) takes tens of milliseconds, which the caller need not spend. Reaped at the next call, by
# :func:`reap_finished` (SanityCallback's steps) and at exit.
_UNREAPED: list[int] = []


def reap_finished(block: bool = False) -> int:
    """Reap the children of earlier calls that have exited (with ``block``, wait for them); how many are left."""
    for pid in list(_UNREAPED):
        try:
            done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler of the user's)
            done = pid
        if done:
            _UNREAPED.remove(pid)
    return len(_UNREAPED)


atexit.register(reap_finished, True)


def _child(call: Callable[[], Any], write_end: int) -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if "torch" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["torch"].set_num_threads(1)  # the parent's intra-op pool is not the child's
    try:
        result: tuple[str, Any] = ("ok", call())
    except BaseException as exc:  # the user's code: SystemExit and KeyboardInterrupt included
        result = ("raised", f"{type(exc).__name__}: {exc}")
    try:
        blob = pickle.dumps(result)
    except Exception as exc:
        blob = pickle.dumps(("lost", f"its result could not be sent back ({type(exc).__name__}: {exc})"))
    for stream in (sys.stdout, sys.stderr):  # what the user's code printed
        with contextlib.suppress(Exception):
            stream.flush()
    view = memoryview(blob)
    while view:
        view = view[os.write(write_end, view) :]
    os.close(write_end)


@contextlib.contextmanager
def _fork_environment():
    """What the fork itself should not say or leave: Python 3.12's warning about forking a threaded process, and
    tokenizers' about its thread pool (its parallelism is off in the child, as it would turn it off anyway)."""
    unset = "TOKENIZERS_PARALLELISM" not in os.environ
    if unset:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*fork.*")
            yield
    finally:
        if unset:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


def _kill(pid: int) -> None:
    """The child and its process group, killed and reaped."""
    _kill_group(pid)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
