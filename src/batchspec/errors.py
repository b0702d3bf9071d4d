"""The one exception type users see: a clear, one-line message naming the problem."""


class BatchspecError(Exception):
    """Bad input or an unusable model/file. The CLI prints `error: <message>` and exits with status 2."""
