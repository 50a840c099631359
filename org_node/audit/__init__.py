"""The privacy audit: signed, hash-chained egress log and verifiable per-run reports.

``docs/SECURITY.md``, "Privacy audit". :class:`~org_node.audit.log.EgressLog` is the
endpoint's egress hook; :func:`~org_node.audit.report.build_report` writes the signed
report of a run; :func:`~org_node.audit.html.render_html` renders it as one offline
HTML page; :func:`~org_node.audit.verify.verify_path` checks a log or a report.
"""

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
from org_node.audit.log import (
    AuditError,
    DatabaseStore,
    EgressEntry,
    EgressLog,
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
from org_node.audit.verify import VerifyResult, verify_log, verify_path, verify_report

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
