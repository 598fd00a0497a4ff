"""The two kinds of failure a user sees: one clear line each, never a traceback.

`UsageError` is a mistake in what the user asked for (exit code 2); `RunError` is something that
went wrong while doing it (exit code 1). Both carry a hint: the way out.
"""


class PagedCliError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class UsageError(PagedCliError):
    exit_code = 2


class RunError(PagedCliError):
    exit_code = 1
