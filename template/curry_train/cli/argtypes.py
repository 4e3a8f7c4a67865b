"""Argument checking for `curry-train`: numeric option types with their valid range, a parser whose errors are one
line (exit 2, no traceback), and help that shows each option's default.

    p.add_argument("--steps", type=int_at_least(1), default=5, help="timed steps")
    # curry-train bench --steps -3  ->  curry-train bench: argument --steps: must be an integer >= 1, got '-3'
    #                                   (see curry-train bench --help)   [exit 2]

Checking in argparse (a `type` function) refuses bad input before any config is read or any process starts, and
names the option - the function raising deep inside bench() gave a traceback and exit 1.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn


def int_at_least(lo: int, what: str = "an integer", *, allow_exponent: bool = False) -> Callable[[str], int]:
    """argparse type: an integer >= lo (with allow_exponent, also a whole number written as 2e6)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            f = _float_or_none(text) if allow_exponent else None
            if f is None or not f.is_integer():
                raise argparse.ArgumentTypeError(f"must be {what} >= {lo}, got {text!r}") from None
            v = int(f)
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be {what} >= {lo}, got {text!r}")
        return v

    parse.__name__ = f"int>={lo}"
    return parse


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1..65535 (0 would make the OS pick one the client cannot know)."""
    v = int_at_least(1, "a port number")(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number <= 65535, got {text!r}")
    return v


def _float_or_none(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def float_in(lo: float, hi: float = math.inf, *, lo_open: bool = True, hi_open: bool = True,
             what: str = "a number") -> Callable[[str], float]:
    """argparse type: a finite float in (lo, hi) (each end open or closed); nan and inf are refused."""
    left, right = ("(" if lo_open else "["), (")" if hi_open else "]")
    rng = f"> {lo:g}" if hi == math.inf else f"in {left}{lo:g}, {hi:g}{right}"
    if hi == math.inf and not lo_open:
        rng = f">= {lo:g}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} {rng}, got {text!r}") from None
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {what} {rng}, got {text!r}")
        return v

    parse.__name__ = f"float {rng}"
    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)
positive_float = float_in(0.0)
seconds = float_in(0.0, what="a number of seconds")
byte_count = int_at_least(1, "a whole number of bytes", allow_exponent=True)  # 2000000 or 2e6


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends '(default: X)' to an option's help when it has a real default the text does not already state
    (argparse.ArgumentDefaultsHelpFormatter also prints 'default: None' and 'default: False')."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (not action.option_strings or d is None or d is False or d == [] or d is argparse.SUPPRESS
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class CliParser(argparse.ArgumentParser):
    """ArgumentParser with one-line errors (exit 2) and defaults in the help; subparsers inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block first; one line naming the option and the fix is easier to act on.
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def stdout_closed() -> int:
    """A reader closed our stdout (`curry-train ... | head`): point stdout at /dev/null so the interpreter's final
    flush cannot raise again, and exit like a command killed by SIGPIPE (128 + 13; Python docs, 'Note on SIGPIPE')."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141
