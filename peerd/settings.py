"""Where the daemon's settings come from when no flag gives them.

Order: a flag, then a ``PEERD_<NAME>`` environment variable (what docker compose sets), then a
TOML file (``--config PATH`` or ``PEERD_CONFIG``), then the built-in default. The file uses the
variables' names in lower case, so every setting has one name in all three places::

    # peer.toml
    run_id = "my-run"
    initial_peers = ["10.0.0.5:31337", "10.0.0.6:31337/PEERID"]
    task = "digits"
    status_port = 8080
    client_mode = false

A key the daemon does not know (``check_known``, with the declared settings' keys) is an error,
not ignored: a misspelt setting would otherwise silently fall back to its default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["Settings", "SettingsError", "CONFIG_VARIABLE", "ENV_PREFIX", "parse_bool"]

CONFIG_VARIABLE = "PEERD_CONFIG"
ENV_PREFIX = "PEERD_"


class SettingsError(ValueError):
    """A configuration file that cannot be read or holds something we cannot use."""


class Settings:
    """Looks a setting up in the environment, then in the config file's values."""

    def __init__(self, environ: Mapping[str, str] | None = None, file_values: Mapping[str, Any] | None = None,
                 source: str | None = None):  # fmt: skip
        self._environ = dict(os.environ if environ is None else environ)
        texts = {key: _as_text(key, value, source) for key, value in (file_values or {}).items()}
        self._file = {key: text for key, text in texts.items() if text != ""}  # empty = unset, as in the environment
        self.source = source

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from ``path``, or from the file that ``PEERD_CONFIG`` names, or from the
        environment alone when neither is given."""
        environ = os.environ if environ is None else environ
        if path is None:
            path = environ.get(CONFIG_VARIABLE) or None
        if path is None:
            return cls(environ)
        try:
            with open(path, "rb") as file:
                values = tomllib.load(file)
        except OSError as error:
            raise SettingsError(f"cannot read config file {path}: {error.strerror or error}") from None
        except tomllib.TOMLDecodeError as error:
            raise SettingsError(f"config file {path} is not valid TOML: {error}") from None
        return cls(environ, values, os.fspath(path))

    def get(self, name: str, default: str | None = None) -> str | None:
        """The setting ``name`` (upper case, as in ``PEERD_<NAME>``) as text, or ``default``."""
        value = self._environ.get(ENV_PREFIX + name)
        if value not in (None, ""):
            return value
        value = self._file.get(name.lower())
        return value if value is not None else default

    def parsed(self, name: str, parse: Callable[[str], Any], default: Any = None) -> Any:
        """The setting converted by ``parse`` (``default`` if unset); a value ``parse`` refuses
        raises SettingsError saying which variable or file key held it."""
        text = self.get(name)
        if text is None:
            return default
        try:
            return parse(text)
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise SettingsError(f"{self.origin(name)}: {error}") from None

    def origin(self, name: str) -> str:
        if self._environ.get(ENV_PREFIX + name) not in (None, ""):
            return ENV_PREFIX + name
        return f"{name.lower()} in {self.source}"

    def check_known(self, keys: Collection[str]) -> None:
        """Raise SettingsError naming every key of the file that is not among ``keys`` (the
        declared settings' file keys: ``join_arguments.KNOWN_FILE_KEYS``)."""
        unknown = sorted(set(self._file) - set(keys))
        if unknown:
            raise SettingsError(
                f"{self.source}: unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                f" (known: {', '.join(sorted(keys))})"
            )


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no), got {text!r}")


def _as_text(key: str, value: Any, source: str | None) -> str:
    """A TOML value in the form its environment variable would have."""
    if isinstance(value, bool):  # (before int: bool is an int)
        return "1" if value else "0"
    if isinstance(value, (str, int, float)):
        return str(value)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return " ".join(value)
    raise SettingsError(f"{source}: setting {key!r} must be a string, number, boolean or list of strings")
