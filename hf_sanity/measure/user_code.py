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

Many calls, one child (:class:`OneChild`, the reward dry run): a fork copies the page tables of a process that
holds a model (~10 ms for the tiny benchmark trainer's ~350 MB of its own memory, more for a larger one), so the
dry run makes every call of every reward function in sequence in ONE forked child, as TRL makes them in one
process. Each call there has its own time limit: a timer (``SIGALRM``, in the child's main thread) raises at the
deadline and the next call goes on; the parent also keeps a deadline for whatever the child is doing (a call: its
limit and :data:`GRACE`; hf-sanity's own work between calls: the same), on the child's clock, and kills the group
there: a call stuck in C code, where no signal handler runs, is reported as timed out and the steps after it as
not run. What a call that timed out started is killed with the group when the child's work is over (before the
caller reads the outcomes). The child's steps return plain data, step by step, so what was judged before a kill
stays judged. The parent need not wait: it may go on and read the outcomes later (SanityCallback reads them at the
first step's end), or abandon the child (killed and reaped).

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
import struct
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# torch's message when a forked child touches CUDA the parent initialised.
CUDA_IN_FORK = "Cannot re-initialize CUDA in forked subprocess"
NO_FORK = "this platform has no os.fork: a call that outlives its time limit could not be stopped"
CUDA_SKIPPED = "it uses CUDA, which the dry run's forked process cannot: not judged"
# Seconds past a deadline before the parent kills a child whose own timer did not stop the call (stuck in C code).
GRACE = 1.0
NOT_RUN = "not run: an earlier call of the dry run stopped its process"

# In a child of :func:`run_in_one_child`: the pipe its messages go to (None in every other process). There
# :func:`run_isolated` calls the user's code in place, under a timer: the child is the isolation.
_CHANNEL: int | None = None


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

    if _CHANNEL is not None:  # in a child of run_in_one_child already: called here, under its timer
        return _limited(call, timeout)
    if not can_isolate():
        return Outcome(skipped=NO_FORK)
    started = time.perf_counter()
    with preserved_rng():
        status, payload = _fork_and_wait(call, timeout)
    return _outcome(status, payload, timeout, time.perf_counter() - started)


def _outcome(status: str, payload: Any, timeout: float, seconds: float) -> Outcome:
    if status == "ok":
        return Outcome(value=payload, seconds=seconds)
    if status == "raised":
        if CUDA_IN_FORK in payload:
            return Outcome(skipped=CUDA_SKIPPED, seconds=seconds)
        return Outcome(error=payload, seconds=seconds)
    if status == "timeout":
        return Outcome(error=f"did not return within {timeout:g} s", timed_out=True, seconds=seconds)
    return Outcome(skipped=payload, seconds=seconds)  # "lost": the child died or its result was unreadable


def _fork_child(work: Callable[[int], None]) -> tuple[int, int]:
    """A forked child that runs ``work(write_end)`` in a process group of its own and never returns into the
    caller's stack; the parent's (child's pid, the pipe's read end)."""
    read_end, write_end = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # buffered output would be written twice, by both processes
        with contextlib.suppress(Exception):
            stream.flush()
    with _fork_environment():
        pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            work(write_end)
        finally:
            os._exit(0)
    os.close(write_end)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also done by the child: whichever runs first, the group exists
    return pid, read_end


def _fork_and_wait(call: Callable[[], Any], timeout: float) -> tuple[str, Any]:
    """(status, payload): ("ok", value), ("raised", "Type: message"), ("timeout", None) or ("lost", why)."""
    pid, read_end = _fork_child(lambda write_end: _child(call, write_end))
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


def _child_setup() -> None:
    """In a forked child: a process group of its own (killed whole), one torch thread (the parent's pool is gone)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if "torch" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["torch"].set_num_threads(1)  # the parent's intra-op pool is not the child's


def _child(call: Callable[[], Any], write_end: int) -> None:
    _child_setup()
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


# -- many calls in one child ----------------------------------------------------------------------------------
def run_in_one_child(steps: Sequence[Callable[[], Any]], timeout: float) -> list[Outcome]:
    """Each of ``steps`` in order, in ONE forked child; an :class:`Outcome` for each (its value: what the step
    returned, plain data). A step is hf-sanity's own code that calls the user's through :func:`run_isolated`, which
    in that child calls it in place under a timer of its own limit. The parent kills the child's group when a
    call outlives its limit by :data:`GRACE` (or hf-sanity's work between calls outlives ``timeout`` by as much):
    that step is timed out, the steps after it not run (:data:`NOT_RUN`). The parent's RNG states are restored
    around the fork, as around :func:`run_isolated`."""
    return OneChild(steps, timeout).outcomes()


class OneChild:
    """The parent's side of :func:`run_in_one_child`, started here and waited for later (:meth:`outcomes`): the
    child works while the parent goes on. Its deadlines are on the child's clock (each message carries the
    system's monotonic time), so a parent that reads late still judges each call by its own limit."""

    def __init__(self, steps: Sequence[Callable[[], Any]], timeout: float) -> None:
        from hf_sanity.untouched import preserved_rng

        self.count, self.timeout = len(steps), timeout
        self.results: list[Outcome] = []
        self.pid: int | None = None
        self.expired = False  # a call stopped by the child's timer (it may have left processes)
        self._data = bytearray()
        if not steps:
            return
        if not can_isolate():
            self.results = [Outcome(skipped=NO_FORK) for _ in steps]
            return
        with preserved_rng():
            self.pid, self._read_end = _fork_child(lambda write_end: _child_steps(steps, write_end))
        self._step_started = time.monotonic()
        self._limit = timeout  # what the child is doing now may take this long (and GRACE)
        self._deadline = self._step_started + timeout + GRACE

    @property
    def finished(self) -> bool:
        """Every step's outcome is in (reading what the child has sent so far, without waiting)."""
        if self.pid is not None:
            self._pump(block=False)
        return self.pid is None

    def outcomes(self) -> list[Outcome]:
        """Each step's outcome, waiting for the child as long as its deadlines allow."""
        if self.pid is not None:
            self._pump(block=True)
        return self.results

    def abandon(self, why: str) -> None:
        """The caller goes no further (the run failed): the child and its group killed and reaped; the steps
        without an outcome say ``why``."""
        if self.pid is None:
            return
        _kill(self.pid)
        self._close(reaped=True, rest=why)

    def _pump(self, *, block: bool) -> None:
        while len(self.results) < self.count:
            left = self._deadline - time.monotonic()
            if left <= 0:  # the backstop: the child's timer did not stop the call (or hf-sanity's work hung)
                _kill(self.pid)
                self.results.append(Outcome(error=f"did not return within {self._limit:g} s", timed_out=True,
                                            seconds=time.monotonic() - self._step_started))  # fmt: skip
                return self._close(reaped=True)
            ready, _, _ = select.select([self._read_end], [], [], left if block else 0)
            if not ready:
                if block:
                    continue
                return None
            chunk = os.read(self._read_end, 1 << 16)
            if not chunk:  # the child ended before it sent every step
                _, status = os.waitpid(self.pid, 0)
                code = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status
                self.results.append(Outcome(skipped=f"the call ended its process (exit status {code}) before "
                                            "it returned", seconds=time.monotonic() - self._step_started))  # fmt: skip
                return self._close(reaped=True)
            self._data += chunk
            for message in _messages(self._data):
                self._take(message)
        return self._close(reaped=False)

    def _take(self, message: tuple) -> None:
        kind, sent = message[0], message[1]
        if kind == "call":  # a call of the user's code begins: its own limit
            self._limit = message[2]
        elif kind == "expired":  # the child's timer stopped a call; the child goes on
            self.expired, self._limit = True, self.timeout
        elif kind == "returned":
            self._limit = self.timeout
        else:  # "step": one step's result
            seconds = sent - self._step_started
            self.results.append(_outcome(message[2], message[3], self.timeout, seconds))
            self._step_started, self._limit = sent, self.timeout
        self._deadline = sent + self._limit + GRACE

    def _close(self, *, reaped: bool, rest: str = NOT_RUN) -> None:
        pid, self.pid = self.pid, None
        os.close(self._read_end)
        self.results += [Outcome(skipped=rest) for _ in range(self.count - len(self.results))]
        _kill_group(pid)  # what the calls started and left behind (the group's id lives while it has members)
        if reaped:
            return
        if (
            self.expired
        ):  # a call stopped by its timer may have started processes: gone before the caller goes on
            _kill(pid)
        else:  # its exit, the teardown of a copy of the trainer's process, is not waited for
            _UNREAPED.append(pid)
            reap_finished()


_LENGTH = struct.Struct("!I")


def _messages(data: bytearray) -> list[tuple]:
    """The complete messages at the start of ``data`` (removed from it): each a length, then a pickle."""
    out = []
    while len(data) >= _LENGTH.size:
        (size,) = _LENGTH.unpack_from(data)
        if len(data) < _LENGTH.size + size:
            break
        blob = bytes(data[_LENGTH.size : _LENGTH.size + size])
        del data[: _LENGTH.size + size]
        out.append(pickle.loads(blob))
    return out


def _send(message: tuple) -> None:
    """In the child: one message to the parent (a step's result that cannot be pickled is sent as lost)."""
    try:
        blob = pickle.dumps(message)
    except Exception as exc:
        why = f"its result could not be sent back ({type(exc).__name__}: {exc})"
        blob = pickle.dumps(("step", time.monotonic(), "lost", why))
    view = memoryview(_LENGTH.pack(len(blob)) + blob)
    while view:
        view = view[os.write(_CHANNEL, view) :]


def _child_steps(steps: Sequence[Callable[[], Any]], write_end: int) -> None:
    global _CHANNEL
    _CHANNEL = write_end
    _child_setup()
    for step in steps:
        try:
            result: tuple[str, Any] = ("ok", step())
        except BaseException as exc:  # hf-sanity's step: the user's code inside it is caught by _limited
            result = ("raised", f"{type(exc).__name__}: {exc}")
        _send(("step", time.monotonic(), *result))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.close(write_end)


class _OutOfTime(BaseException):
    """Raised by the child's timer into the user's call at its deadline (not an Exception: a ``try`` in the user's
    code that catches Exception does not swallow it)."""


def _limited(call: Callable[[], Any], timeout: float) -> Outcome:
    """In a child of :func:`run_in_one_child`: ``call()`` in place, stopped by a timer at ``timeout``."""
    armed = [True]

    def expire(signum, frame):
        if armed[0]:
            raise _OutOfTime

    _send(("call", time.monotonic(), timeout))
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    started = time.perf_counter()
    try:
        try:
            status, payload = "ok", call()
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _OutOfTime:
        status, payload = "timeout", None
    except BaseException as exc:  # the user's code: SystemExit and KeyboardInterrupt included
        status, payload = "raised", f"{type(exc).__name__}: {exc}"
    finally:
        signal.signal(signal.SIGALRM, previous)
    seconds = time.perf_counter() - started
    _send(("expired" if status == "timeout" else "returned", time.monotonic()))
    return _outcome(status, payload, timeout, seconds)


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
