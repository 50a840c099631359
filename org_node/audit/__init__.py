"""The privacy audit: signed, hash-chained egress log and verifiable per-run reports.

``docs/SECURITY.md``, "Privacy audit". :class:`~org_node.audit.log.EgressLog` is the
endpoint's egress hook; :func:`~org_node.audit.report.build_report` writes the signed
report of a run; :func:`~org_node.audit.html.render_html` renders it as one offline
HTML page; :func:`~org_node.audit.verify.verify_path` checks a log or a report.

What it owns: the egress log's records and hashes (``records``), the chain check
(``chain``), the log itself (``log``), the privacy classes of message kinds
(``classes``), the exchange of signed heads (``heads``), the run reports (``report``,
``html``, ``facts``, and their DP section, ``dp_section``), their verification (``verify``) and the ``audit`` commands
(``cli``).

What it may import: ``coordinator_free`` and ``secure_agg`` (identities, envelopes,
the endpoint, DP parameters) and the rest of ``org_node`` (policies, privacy
accounting, the database); never ``api``. Inside the package the modules form layers
with no cycle (``pyproject.toml`` holds the import-linter contract), each importing
only those below it: ``cli``; ``facts``; ``verify`` and ``heads``; ``report``;
``html``, ``log`` and ``dp_section``; ``chain``; ``records``; ``classes``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from org_node.audit.chain import VerifyResult
    from org_node.audit.classes import (
        FORBIDDEN_CLASSES,
        ClassificationError,
        ForbiddenClass,
        PrivacyClass,
        UnclassifiedKind,
        classify,
    )
    from org_node.audit.heads import HEAD_KIND, publish_head, serve_heads
    from org_node.audit.html import render_html
    from org_node.audit.log import DatabaseStore, EgressLog
    from org_node.audit.records import (
        AuditError,
        EgressEntry,
        LogFormatError,
        SignedHead,
        read_log,
    )
    from org_node.audit.report import (
        ConsentRecord,
        DpFacts,
        ReportError,
        RoundFacts,
        RunFacts,
        SecAggFacts,
        ShardHeld,
        UnknownRun,
        build_report,
        report_to_bytes,
        round_facts_from_engine,
        save_report,
        validate_report,
    )
    from org_node.audit.verify import verify_log, verify_path, verify_report

# Exports are imported on first use: the report pulls in the DP accountant (scipy),
# which a client command of the CLI that imports this package must not pay for.
_EXPORTS = {
    "AuditError": "org_node.audit.records",
    "ClassificationError": "org_node.audit.classes",
    "ConsentRecord": "org_node.audit.report",
    "DatabaseStore": "org_node.audit.log",
    "DpFacts": "org_node.audit.report",
    "EgressEntry": "org_node.audit.records",
    "EgressLog": "org_node.audit.log",
    "FORBIDDEN_CLASSES": "org_node.audit.classes",
    "ForbiddenClass": "org_node.audit.classes",
    "HEAD_KIND": "org_node.audit.heads",
    "LogFormatError": "org_node.audit.records",
    "PrivacyClass": "org_node.audit.classes",
    "ReportError": "org_node.audit.report",
    "RoundFacts": "org_node.audit.report",
    "RunFacts": "org_node.audit.report",
    "SecAggFacts": "org_node.audit.report",
    "ShardHeld": "org_node.audit.report",
    "SignedHead": "org_node.audit.records",
    "UnclassifiedKind": "org_node.audit.classes",
    "UnknownRun": "org_node.audit.report",
    "VerifyResult": "org_node.audit.chain",
    "build_report": "org_node.audit.report",
    "classify": "org_node.audit.classes",
    "publish_head": "org_node.audit.heads",
    "read_log": "org_node.audit.records",
    "render_html": "org_node.audit.html",
    "report_to_bytes": "org_node.audit.report",
    "round_facts_from_engine": "org_node.audit.report",
    "save_report": "org_node.audit.report",
    "serve_heads": "org_node.audit.heads",
    "validate_report": "org_node.audit.report",
    "verify_log": "org_node.audit.verify",
    "verify_path": "org_node.audit.verify",
    "verify_report": "org_node.audit.verify",
}


__all__ = [
    "FORBIDDEN_CLASSES",
    "HEAD_KIND",
    "AuditError",
    "ClassificationError",
    "ConsentRecord",
    "DatabaseStore",
    "DpFacts",
    "EgressEntry",
    "EgressLog",
    "ForbiddenClass",
    "LogFormatError",
    "PrivacyClass",
    "ReportError",
    "RoundFacts",
    "RunFacts",
    "SecAggFacts",
    "ShardHeld",
    "SignedHead",
    "UnclassifiedKind",
    "UnknownRun",
    "VerifyResult",
    "build_report",
    "classify",
    "publish_head",
    "read_log",
    "render_html",
    "report_to_bytes",
    "round_facts_from_engine",
    "save_report",
    "serve_heads",
    "validate_report",
    "verify_log",
    "verify_path",
    "verify_report",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
