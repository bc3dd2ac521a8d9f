"""Errors that reach the user as one line (exit code 2), never as a traceback."""


class UserInputError(Exception):
    """Bad input: a missing path, a malformed file, an unknown rule slug, a model folder without weights.

    The message names the problem and the fix in one line; the CLI prints it and exits with code 2.
    """
