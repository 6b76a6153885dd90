"""Where settings come from: ``WORKER_*`` environment variables, then ``run`` flags (which win).

An unknown ``WORKER_*`` variable or flag fails start-up with the closest known name
suggested, instead of being ignored; an empty variable counts as unset, because
compose files pass ``${VAR:-}`` through.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from worker.settings.schema import ENV_PREFIX, SETTINGS_SPEC, ConfigError, Settings, SettingSpec

__all__ = [
    "add_run_arguments",
    "add_setting_arguments",
    "load_settings",
    "read_settings",
    "settings_env_names",
    "settings_from_args",
]


def settings_env_names() -> frozenset[str]:
    """Every ``WORKER_*`` environment variable the settings know."""
    return frozenset(spec.env for spec in SETTINGS_SPEC)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting to ``parser``; its help names the env var and default.

    Flags default to "absent" so that the environment applies unless a flag is given.
    """
    add_setting_arguments(parser, SETTINGS_SPEC)


def add_setting_arguments(parser: argparse.ArgumentParser, specs: Iterable[SettingSpec]) -> None:
    """Add the flags of ``specs`` only (for a command that needs a few settings)."""
    group = parser.add_argument_group("settings (flags override WORKER_* environment variables)")
    for spec in specs:
        help_text = f"{spec.help} [env {spec.env}; default: {spec.default_doc()}]"
        group.add_argument(
            spec.flag,
            dest=spec.field,
            metavar=spec.kind.metavar(),
            default=argparse.SUPPRESS,
            help=help_text.replace("%", "%%"),
        )


class _FlagParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print usage and exit; start-up errors go through ConfigError.
        raise ConfigError("argv", f"invalid arguments: {message}")


def _closest(name: str, known: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _check_unknown_env(env: Mapping[str, str]) -> None:
    known = settings_env_names()
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known:
            hint = _closest(name, sorted(known))
            raise ConfigError(name, f"{name}: unknown setting{hint}")


def settings_from_args(
    env: Mapping[str, str], flags: argparse.Namespace, *, isatty: bool = False
) -> Settings:
    """Build the settings from ``env`` and a namespace filled by `add_run_arguments` flags.

    For a CLI that parses its own arguments; `load_settings` is the usual entry point.
    """
    sections = read_settings(env, flags, SETTINGS_SPEC, isatty=isatty)
    built: dict[str, Any] = {name: cls(**sections[name]) for name, cls in Settings.SECTIONS.items()}
    return Settings(**built)


def read_settings(
    env: Mapping[str, str],
    flags: argparse.Namespace,
    specs: Iterable[SettingSpec],
    *,
    isatty: bool = False,
) -> dict[str, dict[str, Any]]:
    """The values of ``specs`` from ``env`` and ``flags`` (flags win), by section and field.

    Settings left unset are absent (their section's default applies). Raises
    ConfigError naming the setting, and for any unknown ``WORKER_*`` variable.
    """
    _check_unknown_env(env)
    sections: dict[str, dict[str, Any]] = {name: {} for name in Settings.SECTIONS}
    for spec in specs:
        flag_value: str | None = getattr(flags, spec.field, None)
        if flag_value is not None:
            source, raw = spec.flag, flag_value
        elif env.get(spec.env, ""):
            source, raw = spec.env, env[spec.env]
        elif spec.required:
            raise ConfigError(spec.env, f"{spec.env}: required, set it or pass {spec.flag}")
        else:
            if spec.doc.contextual_default is not None:
                sections[spec.section][spec.field] = spec.doc.contextual_default(isatty)
            continue
        try:
            sections[spec.section][spec.field] = spec.kind.parse(raw)
        except ValueError as exc:
            shown = "***" if spec.secret else repr(raw)
            raise ConfigError(spec.env, f"{source}: {exc}, got {shown}") from None
    return sections


def load_settings(
    env: Mapping[str, str], argv: Sequence[str] = (), *, isatty: bool = False
) -> Settings:
    """Build the settings from environment variables, then ``run`` flags (flags win).

    ``isatty`` says whether stderr is a terminal; it picks the default log format.
    Raises ConfigError naming the setting at the first problem.
    """
    parser = _FlagParser(prog="run", add_help=False, allow_abbrev=False, exit_on_error=False)
    add_run_arguments(parser)
    try:
        namespace, extra = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        flag = exc.argument_name or "argv"
        raise ConfigError(flag, f"{flag}: {exc.message}") from None
    if extra:
        unknown = extra[0].split("=", 1)[0]
        hint = _closest(unknown, [spec.flag for spec in SETTINGS_SPEC])
        raise ConfigError(unknown, f"{unknown}: unknown flag{hint}")
    return settings_from_args(env, namespace, isatty=isatty)
