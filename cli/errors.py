"""Command-line errors: one clear line on stderr and exit status 2, never a traceback.

A command raises CLIError for a mistake in what it was given (or lets one of USER_ERRORS through:
a missing file, an unknown model name); `meshserve`'s main() prints it as one line. Option
parsing errors are one line too (ArgumentParser below), instead of argparse's usage block.
"""

from __future__ import annotations

import argparse
import sys

from meshserve.shared.models_repo import UnknownModel

EXIT_USAGE = 2


class CLIError(Exception):
    """A mistake in the command line or in the files and servers it names."""


USER_ERRORS = (CLIError, UnknownModel, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def message(e: BaseException) -> str:
    """One line for an error: the OS's words and the path for file errors, else the exception's text."""
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.strerror}: {e.filename}"
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())


def fail(prog: str, e: BaseException | str) -> int:
    print(f"{prog}: error: {e if isinstance(e, str) else message(e)}", file=sys.stderr)
    return EXIT_USAGE


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad option is one line (`prog: error: ... (see prog --help)`), exit status 2."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        sys.exit(fail(self.prog, f"{message} (see {self.prog} --help)"))
