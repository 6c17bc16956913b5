"""The base class of errors caused by user input (files, flags, configs).

The CLI prints these as one clean message (no traceback); anything else is a bug and keeps its
traceback. Each message names the file, the line or key, and the problem.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user: the message says where and what."""
