"""What every ``hetquant`` command shares: the error policy, ``-v``, and input/output checks.

The policy (DESIGN.md, exit codes): bad input or usage is one line on stderr, ``error: …``, and
exit 2 — a :class:`HetquantError`, an ``OSError`` (``PATH: reason``) and a click usage error
alike; ``-v`` adds the traceback of the first two. :class:`HetquantGroup` applies it to every
command it holds, and gives each of them a ``-v`` of its own, so ``hetquant -v convert …`` and
``hetquant convert … -v`` mean the same.

``must_exist`` and ``writable_output`` check a command's paths before any work starts: an output
that cannot be written is refused before the compute, not after it.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from hetquant.formats import HetquantError

__all__ = [
    "HetquantGroup",
    "error_line",
    "fail",
    "must_exist",
    "set_verbose",
    "writable_output",
    "write_output",
]

log = logging.getLogger("hetquant")


def error_line(e: BaseException) -> str:
    """The one-line message of a HetquantError or an OSError (``PATH: reason``)."""
    if isinstance(e, OSError) and e.strerror:
        where = " → ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        return f"{where}: {e.strerror}" if where else e.strerror
    return " ".join(str(e).split("\n")) or type(e).__name__


def set_verbose(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """``-v``: debug logging, and tracebacks with the ``error:`` line."""
    if value:
        logging.getLogger().setLevel(logging.DEBUG)


def _verbose_option() -> click.Option:
    return click.Option(
        ["-v", "--verbose"],
        is_flag=True,
        expose_value=False,
        callback=set_verbose,
        help="Debug logging and tracebacks.",
    )


class _OneLineUsage(click.UsageError):
    """A click usage error shown as one ``error:`` line (exit 2) instead of usage + hint."""

    def show(self, file: Any = None) -> None:
        hint = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        click.echo(f"error: {self.format_message()}{hint}", err=True)


def _one_line(e: click.UsageError) -> click.UsageError:
    if isinstance(e, click.exceptions.NoArgsIsHelpError):  # bare `hetquant`: the help text
        return e
    return _OneLineUsage(e.format_message(), e.ctx)


def fail(e: BaseException) -> None:
    """Report ``e`` as one ``error:`` line (traceback first with ``-v``) and exit 2."""
    if log.isEnabledFor(logging.DEBUG):
        log.error("failed", exc_info=e)
    click.echo(f"error: {error_line(e)}", err=True)
    sys.exit(2)


class HetquantGroup(click.Group):
    """The ``hetquant`` group: one error policy and a ``-v`` for every command (module doc)."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        if not any(p.name == "verbose" for p in cmd.params):
            cmd.params.append(_verbose_option())
        super().add_command(cmd, name)

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:
            raise _one_line(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise _one_line(e) from None
        except HetquantError as e:
            fail(e)
        except OSError as e:
            if e.errno == errno.EPIPE:  # `hetquant … | head`: click quiets it
                raise
            fail(e)


def must_exist(path: Path) -> None:
    """Refuse a missing input path."""
    if not path.exists():
        raise HetquantError(f"{path}: no such file or directory")


def writable_output(path: Path, option: str) -> None:
    """Refuse, before any work, an output file that could not be written: a missing or
    read-only parent directory, or a directory in the file's place."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise HetquantError(
            f"{option} {path}: directory {parent} does not exist; create it or choose another path"
        )
    if path.is_dir():
        raise HetquantError(f"{option} {path}: is a directory; give a file name")
    if not os.access(parent, os.W_OK):
        raise HetquantError(f"{option} {path}: directory {parent} is not writable")


def write_output(path: Path, data: bytes) -> None:
    """Write an output file; a failure (disk full, ...) names the file."""
    try:
        path.write_bytes(data)
    except OSError as e:
        raise HetquantError(f"{path}: cannot write: {e.strerror or e}") from e
