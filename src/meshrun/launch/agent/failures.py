"""The one-screen failure summary printed when a launched job fails.

When one rank crashes, torchrun stops the others, and every rank shows up as failed:
the real cause is easy to lose among the victims. This module names the rank that
failed *first*, its exit cause and its traceback, and lists the others as likely
victims. It is a pure function of the agent's failure records plus the files the
agent wrote (error files and per-rank logs), so it is unit-tested without processes.

torchrun (2.13) lays out the per-rank files of a run under ``--log-dir`` as::

    LOG_DIR/<rdzv id>_<random>/attempt_<n>/<local rank>/{stdout.log,stderr.log,error.json}

``error.json`` exists only when the worker's entry point is decorated with
``torch.distributed.elastic.multiprocessing.errors.record``.
"""

from __future__ import annotations

import math
import os
import re
import signal
import textwrap
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

TRACEBACK_LINES = 40
MESSAGE_CHARS = 100
TAIL_BYTES = 64 * 1024
NO_ERROR_DATA = "<NONE>"  # torch's placeholder message when a rank wrote no error file
RULE = "=" * 78

# Why a rank dies of a given signal, in the words a user searches for.
SIGNAL_HINTS = {
    "SIGKILL": "killed: out of memory? (the kernel's OOM killer, or a scheduler's hard kill)",
    "SIGTERM": "terminated: stopped by the agent after another rank failed, or preempted",
    "SIGSEGV": "segmentation fault: a crash in native code (CUDA, NCCL, a C extension)",
    "SIGABRT": "aborted: an uncaught C++ exception or a failed check in native code "
    "(NCCL/CUDA on GPUs)",
    "SIGBUS": "bus error: often /dev/shm too small for DataLoader workers",
    "SIGINT": "interrupted (Ctrl-C)",
    "SIGHUP": "hang-up: the terminal or session went away",
}

# torch prefixes an uncaught exception's lines with "[rankN]: "; the summary names the rank.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
# "RuntimeError: ...", "torch.OutOfMemoryError: ...", "KeyboardInterrupt".
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b")
# What libstdc++ prints when a std::thread is destroyed while still joinable: at interpreter
# exit, Gloo's threads outlive the Python code (measured: 8-40% of plain Gloo runs).
TEARDOWN_ABORT = "terminate called without an active exception"
EXIT_HANG = 124  # monitor/watchdog.py's code (not imported: this module stays torch-free)
# Why meshrun launch itself ended a rank after a hang (monitor/watchdog.py's ENDED_FILE).
ENDED_CAUSES = {
    "stopped": "stopped (process state T: SIGSTOP or a debugger) when the hang watchdog fired",
    "not responding": "not responding (running, but its watchdog did not answer)",
}
# meshrun's refusals: config.fields.ConfigError and its subclasses (tests/unit/test_hang_summary.py
# checks this list against src/), bad input every rank meets alike, whose message names the
# key, the value and the fix. The summary shows that message whole and no traceback.
REFUSALS = frozenset(
    {"ConfigError", "RunDirError", "RunDirBusy", "PlanError", "SlurmError", "HostfileError"}
)
# C++ errors start with their source location ("[/__w/.../pair.cc:553] "): noise in one line.
_SOURCE_LOCATION = re.compile(r"\[[^\]]*\.(?:cc|cpp|cu|h|hpp):\d+\] ?")


class FailureLike(Protocol):
    """What the summary reads of torch's ``ProcessFailure`` (a protocol keeps tests light)."""

    @property
    def local_rank(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def exitcode(self) -> int: ...
    @property
    def error_file(self) -> str: ...
    @property
    def error_file_data(self) -> Mapping[str, Any]: ...
    @property
    def timestamp(self) -> int: ...


@dataclass(frozen=True)
class FailureReport:
    """The summary of a failed launch: who failed first, the exit code to return, the text."""

    first_rank: int
    exit_code: int
    text: str


@dataclass(frozen=True)
class HangStates:
    """What meshrun's hang path knows (monitor/watchdog.py's ``hang_states``): the ranks
    ``meshrun launch`` ended itself (rank -> "stopped" or "not responding") and where the
    ranks that reported wait (rank -> "waits in collective #26 (...) of process group 0")."""

    ended: Mapping[int, str] = field(default_factory=dict)
    waiting: Mapping[int, str] = field(default_factory=dict)


def summarize_failures(
    failures: Mapping[int, FailureLike],
    attempt_dir: str | None,
    host: str,
    hang: HangStates | None = None,
) -> FailureReport:
    """Build the summary of ``failures`` (global rank -> failure) of one attempt.

    ``attempt_dir`` is the agent's ``.../attempt_<n>`` folder holding the per-rank logs
    (None if unknown); ``host`` is where these ranks ran; ``hang`` what the hang path found.
    """
    if not failures:
        raise ValueError("summarize_failures needs at least one failure")
    hang = hang or HangStates()
    order = order_failures(failures, attempt_dir, hang.ended)
    first = order[0]
    failure = failures[first]
    stderr_path = _stderr_path(failure, attempt_dir)
    message = _error_message(failure, stderr_path)
    refusal = refusal_of(message)
    if refusal:
        lines = [RULE, f"meshrun launch: rank {first} refused the run (host {host})"]
        lines += _describe_refusal(failure, refusal, stderr_path)
    else:
        lines = [RULE, f"meshrun launch: rank {first} failed first (host {host})"]
        lines += _describe_first(first, failure, stderr_path, hang, message)
    victims = [(rank, failures[rank]) for rank in order[1:]]
    lines += _describe_victims(victims, attempt_dir, hang, refusal)
    lines.append(RULE)
    # A hang ends the launch with the watchdog's code, whichever rank is named first.
    code = EXIT_HANG if hang.ended or hang.waiting else exit_code_of(failure)
    return FailureReport(first_rank=first, exit_code=code, text="\n".join(lines))


def order_failures(
    failures: Mapping[int, FailureLike],
    attempt_dir: str | None,
    ended: Mapping[int, str] | None = None,
) -> list[int]:
    """Ranks ordered from the likely root cause to the last victim.

    torch's own ``get_first_failure`` compares whole-second timestamps and breaks ties by
    local rank, so a victim that crashed in the same second (a Gloo "connection closed by
    peer") can be named as the cause. Here a rank meshrun ended after a hang (stopped, not
    responding: what the others waited for) sorts first, a SIGTERM, which is what the agent
    sends to the survivors, last, and the time each rank last wrote a file refines the order.
    """
    position = {rank: i for i, rank in enumerate(failures)}
    ended = ended or {}

    def key(rank: int) -> tuple[bool, bool, float, int]:
        failure = failures[rank]
        stopped_by_agent = failure.exitcode == -signal.SIGTERM
        time_ = _failure_time(failure, attempt_dir)
        return (rank not in ended, stopped_by_agent, time_, position[rank])

    return sorted(failures, key=key)


def exit_code_of(failure: FailureLike) -> int:
    """The launcher's exit code for a failure: the worker's own, or 1 for a signal."""
    return failure.exitcode if failure.exitcode > 0 else 1


def describe_exit(exitcode: int) -> str:
    """``exit code 3``, or ``signal SIGKILL (killed: out of memory? ...)``."""
    name = signal_name(exitcode)
    if name is None:
        return f"exit code {exitcode}"
    hint = SIGNAL_HINTS.get(name)
    prefix = "signal" if exitcode < 0 else f"exit code {exitcode} = signal"
    return f"{prefix} {name}" + (f" ({hint})" if hint else "")


def signal_name(exitcode: int) -> str | None:
    """The signal behind an exit code: negative codes, and 128+N from shells and containers."""
    if exitcode < 0:
        number = -exitcode
    elif 128 < exitcode < 160:
        number = exitcode - 128
    else:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def find_attempt_dir(log_dir: str, rdzv_id: str, known: Collection[str] = ()) -> str | None:
    """The newest ``attempt_<n>`` folder of the newest run of ``rdzv_id`` under ``log_dir``.

    ``known`` names run folders that existed before this launch, so an older run in the
    same ``log_dir`` is never mistaken for this one.
    """
    if not os.path.isdir(log_dir):
        return None
    runs = [
        os.path.join(log_dir, name)
        for name in os.listdir(log_dir)
        if name.startswith(f"{rdzv_id}_") and name not in known
    ]
    runs = [path for path in runs if os.path.isdir(path)]
    if not runs:
        return None
    run_dir = max(runs, key=os.path.getmtime)
    attempts = [n for n in os.listdir(run_dir) if re.fullmatch(r"attempt_\d+", n)]
    if not attempts:
        return None
    return os.path.join(run_dir, max(attempts, key=lambda n: int(n.split("_")[1])))


def _cause(rank: int, failure: FailureLike, log_tail: list[str], hang: HangStates) -> str:
    """The cause line: meshrun's own hang path first, then the exit code or signal."""
    if rank in hang.ended:
        why = ENDED_CAUSES.get(hang.ended[rank], hang.ended[rank])
        return f"{why}; ended by meshrun launch with SIGKILL"
    if failure.exitcode == EXIT_HANG and rank in hang.waiting:
        return f"exit code {EXIT_HANG}: the hang watchdog (monitor.step_timeout_s) ended it"
    if signal_name(failure.exitcode) == "SIGABRT" and any(TEARDOWN_ABORT in x for x in log_tail):
        return (
            f"{'signal' if failure.exitcode < 0 else f'exit code {failure.exitcode} ='} "
            f"SIGABRT: a C++ abort at interpreter exit ({TEARDOWN_ABORT!r}: the process "
            "group's threads outlived Python's teardown, typically after the script's code "
            "finished); @meshrun.main leaves through os._exit and skips that teardown"
        )
    return describe_exit(failure.exitcode)


def refusal_of(message: str) -> str:
    """``message`` (``Type: text``) if its type is one of meshrun's refusals, else ""."""
    name = message.split(":", 1)[0].strip().rsplit(".", 1)[-1]
    return message if ":" in message and name in REFUSALS else ""


def _describe_refusal(failure: FailureLike, message: str, stderr_path: str | None) -> list[str]:
    lines = textwrap.wrap(
        " ".join(message.split()),
        width=len(RULE),
        initial_indent="  error : ",
        subsequent_indent=" " * 10,
        break_on_hyphens=False,
    )
    lines.append(f"  where : local rank {failure.local_rank}, pid {failure.pid}")
    if stderr_path:
        lines.append(f"  log   : {stderr_path}")
    if os.path.isabs(failure.error_file):
        lines.append(f"  traceback: in {failure.error_file}")
    return lines


def _describe_first(
    rank: int, failure: FailureLike, stderr_path: str | None, hang: HangStates, message: str
) -> list[str]:
    log_tail = _read_tail(stderr_path)
    lines = [
        f"  cause : {_cause(rank, failure, log_tail, hang)}",
        f"  where : local rank {failure.local_rank}, pid {failure.pid}",
    ]
    if rank in hang.waiting:
        lines.append(f"  state : {hang.waiting[rank]}")
    if message:
        lines.append(f"  error : {_shorten(message)}")
    if stderr_path:
        lines.append(f"  log   : {stderr_path}")
    callstack = _error_callstack(failure)
    if callstack:
        lines.append("  traceback (from the error file written by @record):")
        lines += _indent(_tail(callstack.splitlines(), TRACEBACK_LINES))
        return lines
    if log_tail:
        lines.append(f"  last {len(log_tail)} lines of its stderr:")
        lines += _indent(log_tail)
    else:
        lines.append(_no_traceback(failure.exitcode))
    return lines


def _no_traceback(exitcode: int) -> str:
    name = signal_name(exitcode)
    if name is not None:
        # A signal ends the process where it stands: no Python code runs, so even a script
        # decorated with @meshrun.main or torch's @record writes no error file.
        return f"  no traceback: a rank ended by {name} writes no error file and no traceback"
    return (
        "  no traceback captured (no error file, empty stderr): if the script's main() is "
        "not decorated with @meshrun.main (or torch.distributed.elastic's @record), decorate it"
    )


def _describe_victims(
    victims: list[tuple[int, FailureLike]],
    attempt_dir: str | None,
    hang: HangStates,
    refusal: str = "",
) -> list[str]:
    if not victims:
        return []
    lines = ["  also stopped:" if refusal else "  also stopped (likely victims):"]
    shown = victims[:8]  # many ranks stop together: keep the screen for the cause
    for rank, failure in shown:
        cause = signal_name(failure.exitcode) or f"exit code {failure.exitcode}"
        if rank in hang.ended:
            detail = f": {hang.ended[rank]}, ended by meshrun launch"
        elif rank in hang.waiting:
            detail = f": hang watchdog; {hang.waiting[rank]}"
        else:
            message = _error_message(failure, _stderr_path(failure, attempt_dir))
            detail = f": {_shorten(message, 70)}" if message else ""
            if refusal and message == refusal:
                detail = ": the same refusal"
        lines.append(f"    rank {rank} ({cause}){detail}")
    if len(victims) > len(shown):
        rest = ", ".join(str(rank) for rank, _ in victims[len(shown) :])
        lines.append(f"    and ranks {_shorten(rest, 70)}")
    return lines


def _failure_time(failure: FailureLike, attempt_dir: str | None) -> float:
    # The error file is written the moment the exception is recorded; failing that, a
    # rank's stderr log was last written when it died (a SIGKILLed rank writes nothing
    # more, so its log is older than the tracebacks of the ranks that followed it).
    for path in (failure.error_file, _stderr_path(failure, attempt_dir)):
        if path and os.path.isfile(path):
            return os.path.getmtime(path)
    return float(failure.timestamp) if failure.timestamp else math.inf


def _stderr_path(failure: FailureLike, attempt_dir: str | None) -> str | None:
    candidates = []
    # torch writes "<N/A>" when there was no error file; a real one sits beside the logs.
    if os.path.isabs(failure.error_file):
        candidates.append(os.path.join(os.path.dirname(failure.error_file), "stderr.log"))
    if attempt_dir:
        candidates.append(os.path.join(attempt_dir, str(failure.local_rank), "stderr.log"))
    return next((path for path in candidates if os.path.isfile(path)), None)


def _error_message(failure: FailureLike, stderr_path: str | None) -> str:
    message = failure.error_file_data.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    if message and message != NO_ERROR_DATA:
        return str(message)
    # No error file: the exception line is usually among the last a dying rank printed.
    for line in reversed(_read_tail(stderr_path)):
        if _EXCEPTION_LINE.match(line):
            return line
    return ""


def _error_callstack(failure: FailureLike) -> str:
    message = failure.error_file_data.get("message")
    if not isinstance(message, dict):
        return ""
    return str(message.get("extraInfo", {}).get("py_callstack", ""))


def _read_tail(path: str | None) -> list[str]:
    if not path:
        return []
    try:
        with open(path, "rb") as fp:
            # Only the end matters, and a long run's log can be gigabytes.
            fp.seek(max(0, os.path.getsize(path) - TAIL_BYTES))
            text = fp.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    lines = [_RANK_PREFIX.sub("", line) for line in text.splitlines() if line.strip()]
    return _tail(lines, TRACEBACK_LINES)


def _tail(lines: list[str], count: int) -> list[str]:
    if len(lines) <= count:
        return lines
    return [f"... ({len(lines) - count + 1} earlier lines cut)", *lines[-(count - 1) :]]


def _indent(lines: list[str]) -> list[str]:
    return [f"    {line}" for line in lines]


def _shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    text = " ".join(_SOURCE_LOCATION.sub("", text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
