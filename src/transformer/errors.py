"""The errors the CLI prints as one clean message (no traceback): bad user input (files,
flags, configs), and a job's process that was ended from outside (`JobError`). Anything else
is a bug and keeps its traceback. Each message names the file, the line or key, or the
process, and the problem.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user: the message says where and what."""


class JobError(RuntimeError):
    """A process of a `train --procs N` job ended without a word of its own: killed by a
    signal (the kernel's out-of-memory killer's SIGKILL, a user's `kill`) or gone with an exit
    status and no report. Not bad input and not a bug to trace here: the message says which
    process, how it ended, and what the run directory holds."""
