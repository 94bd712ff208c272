"""What every command line here shares (`kvstore`, `kvstore serve`, `kvstore admin`, `conductor`,
`python -m conductor.sim`): a bad value is one line of text naming the flag and what it accepts,
with exit code 2 (never a traceback); `--help` shows defaults; `--version` prints the package's
version; renamed flags keep their old spelling as a hidden alias."""
from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable

USAGE_ERROR = 2  # bad arguments or an unmet precondition, as argparse itself exits


def package_version() -> str:
    """The installed kvstore distribution's version (kvstore and conductor ship together)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("kvstore")
    except (ImportError, PackageNotFoundError):  # pragma: no cover - running from an uninstalled tree
        from .index.records import NodeRecord

        return NodeRecord.__dataclass_fields__["version"].default


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" where there is a default worth showing (not None, False or hidden)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if "%(default)" in help_text or default is None or default is False or default is argparse.SUPPRESS \
                or default == [] or not action.option_strings:
            return help_text
        return help_text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`PROG: error: MESSAGE (see PROG --help)`) and
    whose help shows defaults; its subcommands' parsers are of the same kind."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        fail(self.prog, f"{message} (see {self.prog} --help)")

    def subcommand(self, name: str) -> "Parser":
        """The parser of subcommand `name`."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices[name]
        raise KeyError(name)

    def add_version(self) -> None:
        self.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                          help="print the version and exit")


def fail(prog: str, message: str, code: int = USAGE_ERROR):
    """Print `PROG: error: MESSAGE` as one line on stderr and exit with `code`."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(code)


def alias(parser: argparse.ArgumentParser, *flags: str, dest: str, **kwargs: Any) -> None:
    """An old spelling of a renamed flag: still accepted, not shown in --help."""
    parser.add_argument(*flags, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


# --- value types: each raises ArgumentTypeError with what the flag accepts ---------------------

def size(text: str) -> str:
    """A size such as 512MiB, 4GiB, 1TB or a byte count (kept as text; the daemon parses it)."""
    from .sizes import parse_size

    try:
        if parse_size(text) < 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (a number with an optional unit B, KB, MB, GB, TB, KiB, MiB, GiB or TiB, "
            "e.g. 512MiB or 4GiB)") from None
    return text


def number(kind: type, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           what: str = "") -> Callable[[str], Any]:
    """An int or float within [low, high] ((low, high] with low_open)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        ok = value is not None and math.isfinite(value)  # nan and inf are no numbers
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value <= high
        if not ok:
            noun = "an integer" if kind is int else "a number"
            if low is not None and high is not None:
                bounds = f" in {'(' if low_open else '['}{low:g}, {high:g}]"
            elif low is not None:
                bounds = f" {'>' if low_open else '>='} {low:g}"
            else:
                bounds = ""
            raise argparse.ArgumentTypeError(f"{text!r} is not {what or noun + bounds}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


port = number(int, 0, 65535, what="a port in [0, 65535] (0: any free port)")
positive_int = number(int, 1)
positive_float = number(float, 0, low_open=True)
timeout_seconds = number(float, 0, 3600, low_open=True, what="seconds in (0, 3600]")
MAX_REPLICAS = 16
replica_count = number(int, 1, MAX_REPLICAS, what=f"a replica count in [1, {MAX_REPLICAS}]")
fraction = number(float, 0, 1, low_open=True, what="a fraction in (0, 1]")


def metadata_url(text: str) -> str:
    """etcd://HOST:PORT[,HOST:PORT...], etcd+tls://HOST:PORT?... or memory://NAME, checked without connecting."""
    from .metadata import check_metadata_url

    try:
        check_metadata_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def host_port(text: str) -> str:
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 0.0.0.0:7000; port 0: any free port)")
    return text


def readable_file(text: str) -> str:
    import os

    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a readable file")
    return text
