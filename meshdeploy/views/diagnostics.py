"""Errors and warnings as JSON on stdout for `--json` runs, in the shape of Terraform's
`validate -json` diagnostics: a program reads the same facts a person reads on stderr.

    {"format_version": 1, "valid": false, "error_count": 1, "warning_count": 0,
     "exit_code": 3, "diagnostics": [{"severity": "error", "summary": "...", "detail": "hint",
     "path": "hosts.node2.backend",
     "range": {"filename": "c.yaml", "start": {"line": 7, "column": 14}}}]}

`range` and `path` are there when the problem has a place in a file; `detail` holds the hint
("" when there is none). Errors of a cluster file come in file order, every one of them.
"""

from __future__ import annotations

import json

from meshdeploy.errors import ConfigError, ConfigIssue, MeshdeployError

FORMAT_VERSION = 1


def _issue(issue: ConfigIssue, severity: str = "error") -> dict:
    d = {"severity": severity, "summary": issue.message, "detail": issue.hint or ""}
    if issue.path:
        d["path"] = issue.path
    d["range"] = {"filename": issue.file,
                  "start": {"line": issue.line or None, "column": issue.col or None}}
    return d


def _document(errors: list[dict], warnings: list[str], exit_code: int, **extra) -> str:
    diagnostics = errors + [{"severity": "warning", "summary": w, "detail": ""}
                            for w in warnings]
    doc = {"format_version": FORMAT_VERSION, "valid": not errors, "error_count": len(errors),
           "warning_count": len(warnings), "exit_code": exit_code,
           "diagnostics": diagnostics, **extra}
    return json.dumps(doc, indent=2, ensure_ascii=False)


def render_error(error: BaseException, exit_code: int) -> str:
    """One failed run: every issue of a cluster file in file order, else the one error."""
    if isinstance(error, ConfigError):
        ordered = sorted(error.issues, key=lambda i: (i.line or 0, i.col or 0))
        return _document([_issue(i) for i in ordered], [], exit_code)
    if isinstance(error, MeshdeployError):
        summary, hint = error.message, error.hint or ""
    else:
        summary = f"internal error: {type(error).__name__}: {error}"
        hint = "rerun with --debug for the traceback, and report it"
    return _document([{"severity": "error", "summary": summary, "detail": hint}], [],
                     exit_code)


def render_valid(warnings: list[str], **summary) -> str:
    """`validate --json` of a good file: its warnings and what it holds."""
    return _document([], warnings, 0, **summary)
