"""Messages once per process: a fallback or an ignored setting is said once, not every step.

Why this file exists: the kernels' fallbacks (log records) and the ignored user settings
(``warnings``) must not repeat on every call of a training step. :func:`log_once` and
:func:`warn_once` remember what they said, per cause, for the life of the process.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["log_once", "reset_once", "warn_once"]

_said: set[tuple[str, str]] = set()


def log_once(logger: logging.Logger, key: str, msg: str, *args: object) -> bool:
    """``logger.warning(msg, *args)`` the first time ``(logger.name, key)`` comes up.

    ``key`` names the cause (an op, a reason), so different causes each log once per process.
    Returns whether it logged.
    """
    if (logger.name, key) in _said:
        return False
    _said.add((logger.name, key))
    logger.warning(msg, *args)
    return True


def warn_once(message: str, *, category: type[Warning] = UserWarning, stacklevel: int = 2) -> bool:
    """``warnings.warn(message)`` the first time this text comes up in the process.

    ``stacklevel`` counts from the caller of :func:`warn_once` (2: the caller's caller, the
    user's line when called from a public function). Returns whether it warned.
    """
    if ("warnings", message) in _said:
        return False
    _said.add(("warnings", message))
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    return True


def reset_once() -> None:
    """Forget what has been said (tests)."""
    _said.clear()
