"""The server's log lines: plain text, or `--log-format json` for log shippers (one JSON object per line: time,
level, logger, message, and the request id where the line was written while serving one).

The request id lives in a context variable that the routes set (`request_id_var`), so a line logged anywhere
under a request's handler carries it. In JSON mode uvicorn gets no logging config of its own: its error and
access loggers propagate to the root handler set here, so the access log is JSON too.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("tokenmill_request_id", default=None)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {"time": f"{stamp}.{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}  # fmt: skip
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id is not None:
            line["request_id"] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, log_format: str) -> bool:
    """Set the root logger's level and format; True where the lines are JSON (uvicorn must then keep its hands off
    logging)."""
    if log_format != "json":
        logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
        return False
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    return True
