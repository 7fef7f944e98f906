"""The ``peerd`` argument parser's manners: help that shows each flag's default and its
``PEERD_*`` variable, global flags accepted after the subcommand too, and usage errors that exit
with ``EXIT_USAGE`` (argparse's own 2 is the README's "swarm unreachable")."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from .exit_codes import EXIT_USAGE

__all__ = ["PeerdArgumentParser", "PeerdHelpFormatter", "env_setting", "add_everywhere"]


class PeerdHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``[default: X; env PEERD_NAME]`` to each flag's help. The default shown is the one
    in effect, so a value from the environment or the config file shows as what it will be."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if text is argparse.SUPPRESS:
            return text
        notes = []
        shown = getattr(action, "default_text", None)
        if "%(default)" in text:  # (BooleanOptionalAction says its default itself)
            shown = None
        elif shown is None and action.option_strings and action.default not in (None, argparse.SUPPRESS, False, []):
            if not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                shown = str(action.default)
        if shown is not None:
            notes.append(f"default: {shown}")
        env = getattr(action, "env", None)
        if env is not None:
            notes.append(f"env {env}")
        if notes:
            text = f"{text} [{'; '.join(notes)}]".strip()
        return text.replace("%", "%%").replace("%%(", "%(")


class PeerdArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser (and, through ``add_subparsers``, every subparser) with the formatter
    above and usage errors that exit ``EXIT_USAGE``."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", PeerdHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n(see {self.prog} --help; exit {EXIT_USAGE})\n")


def env_setting(action: argparse.Action, name: str, default_text: str | None = None) -> argparse.Action:
    """Mark ``action`` as also set by ``PEERD_<name>`` (shown in help), with ``default_text`` for
    a default that reads better than its parsed value (``0.0.0.0:31337``, not a tuple)."""
    action.env = f"PEERD_{name}"  # type: ignore[attr-defined]
    if default_text is not None:
        action.default_text = default_text  # type: ignore[attr-defined]
    return action


def add_everywhere(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Accept the top-level options ``flags`` after any subcommand too (``peerd join --log-level
    DEBUG`` as well as ``peerd --log-level DEBUG join``). On subcommands they default to SUPPRESS,
    so a subcommand that does not get the flag never hides the top-level value."""
    originals = [parser._option_string_actions[flag] for flag in flags]
    for sub in _subparsers(parser):
        for action in originals:
            if action.option_strings[0] in sub._option_string_actions:
                continue
            copy = sub.add_argument(
                *action.option_strings,
                dest=action.dest,
                default=argparse.SUPPRESS,
                metavar=action.metavar,
                help=action.help,
                choices=action.choices,
                type=action.type,
            )
            copy.env = getattr(action, "env", None)  # type: ignore[attr-defined]
            if action.default not in (None, argparse.SUPPRESS):
                copy.default_text = str(action.default)  # type: ignore[attr-defined]


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # (aliases map to the same parser)
                found += [sub, *_subparsers(sub)]
    return found
