"""Errors a user can act on. The CLI prints them without a traceback.

UsageError (exit 2): bad flag, bad config, bad data, missing file -- found before work starts.
RunError (exit 1): something failed while running (training diverged, out of memory, ...).
"""


class SwiftliteError(Exception):
    exit_code = 1


class UsageError(SwiftliteError):
    exit_code = 2


class RunError(SwiftliteError):
    exit_code = 1
