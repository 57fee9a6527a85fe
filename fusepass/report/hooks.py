"""What happens when a report is complete, in one place: ``FUSEPASS_REPORT``.

``FUSEPASS_REPORT=1`` prints each report (the table of ``str(report)``) to stderr; any other value but
``0`` is a path, to which each report is appended as one line of JSON (``report.to_json()``: JSON Lines,
so appending keeps the file readable). A report is complete once its graphs are compiled: the forward
graph, and the backward graph when a gradient flows (AOTAutograd compiles it at the first backward). A
report still incomplete when the interpreter exits (no backward ever ran) is published then, with a
notice saying so.
"""
from __future__ import annotations

import atexit
import os
import sys
import warnings

from fusepass.report.report import Report, reports

ENV = "FUSEPASS_REPORT"
NEVER_COMPLETE = "incomplete: a gradient flows, but no backward ran, so the backward graph was never compiled"


def _target() -> str | None:
    value = os.environ.get(ENV, "")
    return None if value in ("", "0") else value


def publish(report: Report) -> None:
    """Print or append the report where FUSEPASS_REPORT says; a failure to do so warns (reporting never breaks
    the model)."""
    target = _target()
    if target is None:
        return
    try:
        if target == "1":
            print(f"{report}\n", file=sys.stderr, flush=True)
            return
        with open(target, "a", encoding="utf-8") as f:
            f.write(report.to_json() + "\n")
    except Exception as error:
        warnings.warn(f"fusepass: {ENV}={target!r}: the report could not be written ({type(error).__name__}: "
                      f"{error})", RuntimeWarning, stacklevel=2)


def report_complete(report: Report) -> None:
    report.complete = True
    publish(report)


@atexit.register
def _publish_incomplete() -> None:
    if _target() is None:
        return
    for report in reports():
        if not report.complete:
            report.notices.append(NEVER_COMPLETE)
            publish(report)
