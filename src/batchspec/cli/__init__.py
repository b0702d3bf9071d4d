"""The `batchspec` command line: one module per subcommand over the shared options in `options.py`."""

from batchspec.cli.main import main

__all__ = ["main"]
