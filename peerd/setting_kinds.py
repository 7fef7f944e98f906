"""What one ``peerd`` setting is, declared as data: its flag, its ``PEERD_*`` variable, its key in
the config file, how its text parses, its default and its help, and from these its argparse
option and its row in the README's table.

A setting has one name everywhere: ``PEERD_<VARIABLE>`` in the environment, ``<variable>`` (lower
case) in the TOML file (``settings.py``), and ``name`` as argparse's destination and the daemon
config's field. Three kinds, each its own class: a value (``Setting``), an on/off switch
(``SwitchSetting``) and a value that only ``peerd join`` parses (``JoinOnlySetting``: a bad one
must break ``join`` alone, with a message naming the variable, never ``peerd status``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from .help import env_setting
from .settings import ENV_PREFIX, Settings, SettingsError, parse_bool

__all__ = ["Setting", "SwitchSetting", "JoinOnlySetting", "setting_field", "from_args"]

T = TypeVar("T")
SETTING = "setting"  # a config field's metadata key: the setting it holds


@dataclass(frozen=True)
class Setting:
    """A flag that takes a value (``--run-id ID``); the variable or file gives the same text."""

    name: str  # argparse's destination, and the daemon config's field
    flag: str
    variable: str  # PEERD_<variable>; the config file's key is its lower case
    help: str  # one line for --help
    default: Any = None
    parse: Callable[[str], Any] = str  # text (flag, variable or file) -> value; raises ValueError
    choices: tuple[str, ...] | None = None  # the values allowed (after parse)
    metavar: str | None = None
    # How --help and the README write the default where the value reads badly (a tuple) or is
    # None and means something ("the task's"); otherwise str(default).
    default_text: str | None = None
    doc: str | None = None  # the README's description (Markdown); None: the help line
    show: Callable[[Any], str] = str  # a value as --help writes it
    # The default as this machine resolves it, for --help (a path under $XDG_DATA_HOME); the
    # README keeps ``default_text``, which holds on every machine.
    local_default: Callable[[], Any] | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.variable

    @property
    def file_key(self) -> str:
        return self.variable.lower()

    def parse_text(self, text: str) -> Any:
        """The value of ``text`` from the variable or the file; ValueError if it is not one."""
        value = self.parse(text)
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"expected one of {', '.join(self.choices)}, got {text!r}")
        return value

    def shown_default(self) -> str | None:
        """The built-in default as --help and the README write it (None: no default to show)."""
        if self.default_text is not None:
            return self.default_text
        return None if self.default is None else self.show(self.default)

    def add_to(self, parser: argparse.ArgumentParser, settings: Settings) -> argparse.Action:
        """Add the flag to ``parser``, its default the variable's or the file's value if set;
        SettingsError (naming the variable or file key) for a value that does not parse."""
        value = settings.parsed(self.variable, self.parse_text, self.default)
        kwargs: dict[str, Any] = {"choices": self.choices}
        if self.parse is not str:
            kwargs["type"] = self.parse
        action = parser.add_argument(
            self.flag, dest=self.name, default=value, metavar=self.metavar, help=self.help, **kwargs
        )
        if settings.get(self.variable) is not None:
            shown = self.show(value)
        elif self.local_default is not None:
            shown = self.show(self.local_default())
        else:
            shown = self.shown_default()
        return self._mark(action, shown)

    def _mark(self, action: argparse.Action, default_text: str | None) -> argparse.Action:
        """What ``help.PeerdHelpFormatter`` shows beside the help: the default in effect and the
        variable."""
        return env_setting(action, self.variable, default_text)

    def readme_row(self) -> str:
        """This setting's row in the README's ``peerd join`` table."""
        flag = f"{self.flag} {self._metavar()}"
        default = self.shown_default()
        if default is None:
            default = "-"
        elif self.default not in (None, ()):  # a value, not a description of what none means
            default = f"`{default}`"
        return _row(f"`{flag}`", f"`{self.env}`", default, self._doc())

    def _metavar(self) -> str:
        """The value's name as argparse writes it in --help."""
        if self.metavar is not None:
            return self.metavar
        return "{" + ",".join(self.choices) + "}" if self.choices is not None else self.name.upper()

    def _doc(self) -> str:
        return self.doc if self.doc is not None else self.help


@dataclass(frozen=True)
class SwitchSetting(Setting):
    """An on/off flag (``--relay`` / ``--no-relay``, so that a flag can undo the variable or the
    file); the variable or file says ``1``/``0``, ``true``/``false``, ``yes``/``no``."""

    default: bool = False
    parse: Callable[[str], Any] = parse_bool

    def add_to(self, parser: argparse.ArgumentParser, settings: Settings) -> argparse.Action:
        action = parser.add_argument(
            self.flag,
            dest=self.name,
            action=argparse.BooleanOptionalAction,
            default=settings.parsed(self.variable, parse_bool, self.default),
            help=self.help,  # (BooleanOptionalAction adds the default)
        )
        return self._mark(action, None)

    def shown_default(self) -> str:
        return "on" if self.default else "off"

    def readme_row(self) -> str:
        """The row names the form that changes something: ``--no-relay`` for a switch that is on."""
        flag = self.flag if not self.default else "--no-" + self.flag.removeprefix("--")
        return _row(f"`{flag}`", f"`{self.env}={0 if self.default else 1}`", self.shown_default(), self._doc())


@dataclass(frozen=True)
class JoinOnlySetting(Setting):
    """A value that only ``peerd join`` parses (``value(args)``), when it runs: the flag is parsed by
    argparse as usual, the variable's or file's text waits in ``args.<name>_setting`` with where
    it came from, so that a bad one breaks ``join`` alone with a message naming it."""

    action: str | None = None  # argparse's action ("extend": a flag that repeats)

    def add_to(self, parser: argparse.ArgumentParser, settings: Settings) -> argparse.Action:
        kwargs: dict[str, Any] = {} if self.action is None else {"action": self.action}
        action = parser.add_argument(
            self.flag, dest=self.name, type=self.parse, default=None, metavar=self.metavar, help=self.help, **kwargs
        )
        text = settings.get(self.variable)
        parser.set_defaults(**{f"{self.name}_setting": (text, settings.origin(self.variable))})
        return self._mark(action, text if text is not None else self.shown_default())

    def value(self, args: argparse.Namespace) -> Any:
        """The flag's value, else the variable's or file's, else the default; SettingsError names
        the variable or file key of a bad one."""
        flagged = getattr(args, self.name)
        if flagged is not None:
            return flagged
        text, origin = getattr(args, f"{self.name}_setting")
        if text is None or not text.strip():  # a blank variable or file value leaves it unset
            return self.default
        try:
            return self.parse_text(text)
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise SettingsError(f"{origin}: {error}") from None


def _row(*cells: str) -> str:
    """A Markdown table row (a ``|`` in a cell, code spans too, is written ``\\|``)."""
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def setting_field(setting: Setting, *, factory: Callable[[Any], Any] | None = None, default: Any = MISSING) -> Any:
    """A config dataclass's field that holds ``setting``: its default is the setting's (through
    ``factory`` for a mutable one: ``factory=list``; ``default`` where a library's differs from
    the command line's), and ``from_args`` fills it from the flags."""
    value = setting.default if default is MISSING else default
    if factory is not None:
        return field(default_factory=lambda: factory(value), metadata={SETTING: setting})
    return field(default=value, metadata={SETTING: setting})


def from_args(config: type[T], args: argparse.Namespace, **derived: Any) -> T:
    """``config`` (a dataclass of ``setting_field``s) with each setting's value from ``args``, and
    the fields in ``derived`` (values worked out from settings: a loaded key, a parsed join-only
    setting) as given; any other field keeps its default."""
    values = {}
    for item in fields(config):  # type: ignore[arg-type]
        if item.name in derived:
            values[item.name] = derived.pop(item.name)
        elif SETTING in item.metadata:
            values[item.name] = getattr(args, item.metadata[SETTING].name)
    if derived:
        raise TypeError(f"{config.__name__} has no field {', '.join(derived)}")
    return config(**values)
