"""One logging setup for every service process.

Lines carry the time, level, service name and id, and the logger name, so logs of many
processes interleaved on one terminal (`sluice serve`) stay readable:

    2025-01-01 12:00:00,123 INFO  [worker 0] services.worker: ready
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)-5s [{service}] %(name)s: %(message)s"
_HANDLER_NAME = "sluice"


def setup_logging(service: str, service_id: str | None = None, level: str = "info") -> None:
    """Send log records to stderr with the service in every line; idempotent.

    `level` is a name (debug, info, warning, error); `SLUICE_LOG_LEVEL` is read by the
    settings, not here. Calling again replaces the handler (a forked child renaming itself).
    """
    label = f"{service} {service_id}" if service_id else f"{service} {os.getpid()}"
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(_FORMAT.format(service=label.replace("%", "%%"))))
    root.addHandler(handler)
    root.setLevel(_level(level))
    # Libraries that log every request at INFO would drown the services' own lines.
    for noisy in ("urllib3", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _level(name: str) -> int:
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):
        raise ValueError(f"unknown log level {name!r}")
    return level
