"""The errors the CLI prints as one clean message (no traceback): bad user input (files,
flags, configs: `UserError`), a run stopped by the machine (`JobError`: memory ran out, a
process killed from outside), and any allocation that failed (`out_of_memory` names it).
Anything else is a bug and keeps its traceback. Each message names the file, the line or key,
or the process, and the problem.
"""

from __future__ import annotations

import re


class UserError(ValueError):
    """Bad input from the user: the message says where and what."""


class JobError(RuntimeError):
    """A run stopped by the machine: memory ran out (an allocation failed), or a process of a
    `train --procs N` job ended without a word of its own (killed by a signal: the kernel's
    out-of-memory killer's SIGKILL, a user's `kill`; or gone with an exit status and no
    report). Not bad input and not a bug to trace here: the message says what happened, where,
    and what the run directory holds."""


def out_of_memory(e: BaseException) -> str | None:
    """The words for `e` if it is an allocation that failed, else None: "out of memory" and how
    much was asked for, where the error says. Python's and numpy's MemoryError, torch's
    RuntimeErrors of a failed allocation or mmap ("can't allocate memory", "Cannot allocate
    memory (12)"), torch.OutOfMemoryError (CUDA's), and a thread that could not start (its
    stack, under a memory limit)."""
    text = str(e)
    if isinstance(e, MemoryError):  # numpy: "Unable to allocate 1.2 GiB for an array ..."
        return _asked(re.search(r"Unable to allocate (\S+ \w+)", text))
    if not isinstance(e, RuntimeError):
        return None
    if text == "can't start new thread":
        return "out of memory or threads (a new thread could not start)"
    if type(e).__name__ == "OutOfMemoryError":  # torch's (CUDA): "Tried to allocate 2.00 GiB"
        return _asked(re.search(r"Tried to allocate (\S+ \w+)", text))
    if "can't allocate memory" in text or "Cannot allocate memory" in text:
        found = re.search(r"(\d+) bytes", text)
        return _asked(found and f"{int(found.group(1)) / 2**20:.1f} MiB")
    return None


def what_to_lower(what: str, smaller: str) -> str:
    """After `out_of_memory`'s words `what`: fewer threads where a thread could not start, else
    `smaller` ("a smaller --beam needs", its verb included) "less"."""
    return "fewer threads (--threads 1) need less" if "thread" in what else f"{smaller} less"


def _asked(amount: re.Match | str | None) -> str:
    if isinstance(amount, re.Match):
        amount = amount.group(1)
    return f"out of memory ({amount} asked for)" if amount else "out of memory"
