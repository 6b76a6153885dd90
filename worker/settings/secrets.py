"""Reading secrets from files: the content never appears in an error, only the setting and path."""

from __future__ import annotations

from pathlib import Path

from worker.settings.fields import ConfigError

__all__ = ["check_file", "read_secret"]


def read_secret(path: str, setting: str) -> str:
    """The stripped text of a secret file; ConfigError naming the setting (never the content)."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(setting, f"{setting}: cannot read {path!r}: {reason}") from None
    if not text:
        raise ConfigError(setting, f"{setting}: {path!r} is empty")
    return text


def check_file(path: str | None, setting: str) -> None:
    """ConfigError naming ``setting`` unless ``path`` (when given) is a readable file."""
    if path is not None and not Path(path).is_file():
        raise ConfigError(setting, f"{setting}: {path!r} is not a readable file")
