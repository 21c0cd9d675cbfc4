"""One declaration per setting: its flag, type, default, environment variable, help, and which
processes `kvmesh up` hands it to. Each service declares its own (`services/NAME/config.py`);
the step limits both ends of a pair size for are declared in shared/step_limits.py.

From a declaration come the service's argparse flag (KVMESH_<FLAG> as its default, checked as
strictly as the flag), what `kvmesh up` takes and forwards, and whether a repository entry's
`[serving]` table may set it for its own pair. A value is checked where it is parsed, so a bad
one is refused by whichever process reads it first, in one line naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from shared.config import is_redis_url, parse_bytes
from shared.errors import KvmeshError

# Who `kvmesh up` hands a setting to (Setting.takers); UP: it takes the flag and places the
# value itself (a model per pair, threads per worker).
UP = "kvmesh-up"
WORKER = "engine-worker"
SCHEDULER = "scheduler"
GATEWAY = "gateway"


@dataclass(frozen=True)
class Setting:
    flag: str  # without the dashes: "kv-memory"
    default: Any
    help: str | None = None
    parse: Callable[[str], Any] = str  # text -> value; raises ArgumentTypeError saying why
    choices: tuple[str, ...] = ()  # the values allowed (checked in place of `parse`)
    switch: bool = False  # a flag without a value; its default is False
    group: str = ""  # the --help section
    takers: tuple[str, ...] = ()  # `kvmesh up` takes it and forwards it to these processes
    per_model: bool = False  # a repository entry's [serving] may set it for its pair

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def check(self) -> Callable[[str], Any]:
        """What a value is parsed with: a choice is checked by it too, since argparse checks
        `choices` only on the command line, not on a default read from the environment."""
        return choice(self.choices) if self.choices else self.parse

    @property
    def env(self) -> str:
        return "KVMESH_" + self.dest.upper()

    def env_default(self) -> Any:
        """The environment's value (still text: argparse parses it as it would the flag)."""
        text = os.environ.get(self.env)
        if text is None:
            return self.default
        if self.switch:
            return text.strip().lower() not in ("", "0", "false", "no", "off")
        return text

    def as_args(self, value: Any) -> list[str]:
        """The value back as arguments (none for an unset one)."""
        if self.switch:
            return [f"--{self.flag}"] if value else []
        if value is None:
            return []
        text = str(value)  # "--flag=-1": a value that looks like a flag stays a value
        return [f"--{self.flag}={text}"] if text.startswith("-") else [f"--{self.flag}", text]


class SettingError(ValueError):
    """A flag, environment variable or [serving] value that is not allowed: one line, which
    names the setting, the value and what is allowed."""


class SettingsParser(argparse.ArgumentParser):
    """An argparse parser whose errors raise SettingError ("PROG: error: ...") for the entry
    point to print as one line with status 2, instead of a usage block."""

    def error(self, message: str) -> NoReturn:
        raise SettingError(f"{self.prog}: error: {message}")


def parse_args_or_exit(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> Any:
    """An entry point's arguments: a bad flag or KVMESH_* value is one line and status 2,
    argparse's status for a bad argument."""
    try:
        return parser.parse_args(argv)
    except SettingError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None


def add_settings(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    groups: dict[str, Any] = {"": parser}
    for setting in settings:
        if setting.group not in groups:
            groups[setting.group] = parser.add_argument_group(setting.group)
        target = groups[setting.group]
        if setting.switch:
            target.add_argument(
                f"--{setting.flag}",
                action="store_true",
                default=setting.env_default(),
                help=setting.help,
            )
            continue
        target.add_argument(
            f"--{setting.flag}",
            default=setting.env_default(),
            type=setting.check,
            choices=setting.choices or None,
            help=setting.help,
        )


def forwarded_args(args: argparse.Namespace, settings: Iterable[Setting], taker: str) -> list[str]:
    """The parsed values of the settings `taker` takes, back as its arguments."""
    return [
        part
        for setting in settings
        if taker in setting.takers
        for part in setting.as_args(getattr(args, setting.dest))
    ]


# What a value may be. Each raises ArgumentTypeError with what is allowed, which argparse
# prefixes with "argument --FLAG: ".


def whole(minimum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}, the least allowed")
        return value

    parse.__name__ = "whole number"
    return parse


def decimal(minimum: float | None = None) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value != value or (minimum is not None and value < minimum):  # NaN too
            raise argparse.ArgumentTypeError(f"{text} is below {minimum}, the least allowed")
        return value

    parse.__name__ = "number"
    return parse


def size(text: str) -> str:
    """A byte size such as 512MiB, kept as written (the configs parse it)."""
    try:
        parse_bytes(text)
    except KvmeshError:
        raise argparse.ArgumentTypeError(
            f"cannot parse a size from {text!r} (for example 512MiB, 4GiB or 1000000)"
        ) from None
    return text


def choice(values: Sequence[str]) -> Callable[[str], str]:

    def parse(text: str) -> str:
        if text not in values:
            allowed = ", ".join(repr(v) for v in values)
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {allowed})")
        return text

    return parse


def choice_list(values: Sequence[str]) -> Callable[[str], str]:
    """Comma-separated choices ("" for none), kept as written."""

    def parse(text: str) -> str:
        for part in (p.strip() for p in text.split(",")):
            if part and part not in values:
                allowed = ", ".join(values)
                raise argparse.ArgumentTypeError(f"{part!r} is not one of {allowed}")
        return text

    return parse


def port(text: str) -> int:
    """A TCP port; 0 picks a free one, -1 turns the listener off where the flag says so."""
    value = whole()(text)
    if not -1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535, or -1 for off)")
    return value


def redis_url(text: str) -> str:
    """A Redis URL redis-py can connect with, kept as written."""
    if not is_redis_url(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a redis://, rediss:// or unix:// URL (e.g. redis://host:6379/0)"
        )
    return text


def readable_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no file at {text!r}")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text


def env_default(flag: str, default: str | None) -> str | None:
    """KVMESH_<FLAG> when set: for a launcher's own flags, which no service takes."""
    return os.environ.get("KVMESH_" + flag.upper().replace("-", "_"), default)
