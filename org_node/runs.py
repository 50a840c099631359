"""The life cycle of a federated run at one org, as a pure transition table.

A run is proposed (by this org or a peer), then this org consents to it or not
(``accept`` / ``decline``). An accepted run starts once the participants' consents
allow it (:mod:`org_node.proposals`); a running run can be paused and resumed, and
ends ``completed``, ``aborted`` (by an operator) or ``failed`` (by the engine). A run
that will not start (a participant declined, or the consent deadline passed without
enough consents) is ``cancelled`` at every participant, with the reason.
``declined``, ``cancelled``, ``completed``, ``aborted`` and ``failed`` are terminal:
the engine never leaves them, and only an admin's ``resume`` takes a ``failed`` run
back to ``running`` (the node refuses it when the failure is not recoverable)::

    proposed --accept--> accepted --start--> running <--pause/resume--> paused
        |                   |                  |  \\--complete--> completed
        +--decline--> declined                 +--fail--> failed --resume--> running
    proposed/accepted --cancel--> cancelled
    proposed/accepted/running/paused --abort--> aborted
    paused --complete--> completed (paused during its last round)

:func:`next_state` is the only entry point; it raises :class:`InvalidTransition`, which
names the current state, for every pair not in :data:`TRANSITIONS`. The table holds no
I/O: the API persists the new state and calls the node's hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType

__all__ = [
    "TERMINAL_STATES",
    "TRANSITIONS",
    "InvalidTransition",
    "RunAction",
    "RunState",
    "allowed_actions",
    "next_state",
]


class RunState(StrEnum):
    """Where a run stands at this org."""

    PROPOSED = "proposed"
    ACCEPTED = "accepted"
    DECLINED = "declined"
    CANCELLED = "cancelled"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"


class RunAction(StrEnum):
    """What can happen to a run (operator commands and engine outcomes)."""

    ACCEPT = "accept"
    DECLINE = "decline"
    START = "start"
    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"
    COMPLETE = "complete"
    FAIL = "fail"
    CANCEL = "cancel"


_S = RunState
_A = RunAction

TRANSITIONS: Mapping[tuple[RunState, RunAction], RunState] = MappingProxyType(
    {
        (_S.PROPOSED, _A.ACCEPT): _S.ACCEPTED,
        (_S.PROPOSED, _A.DECLINE): _S.DECLINED,
        (_S.PROPOSED, _A.ABORT): _S.ABORTED,
        (_S.PROPOSED, _A.CANCEL): _S.CANCELLED,
        (_S.ACCEPTED, _A.START): _S.RUNNING,
        (_S.ACCEPTED, _A.ABORT): _S.ABORTED,
        (_S.ACCEPTED, _A.CANCEL): _S.CANCELLED,
        (_S.RUNNING, _A.PAUSE): _S.PAUSED,
        (_S.RUNNING, _A.ABORT): _S.ABORTED,
        (_S.RUNNING, _A.COMPLETE): _S.COMPLETED,
        (_S.RUNNING, _A.FAIL): _S.FAILED,
        (_S.PAUSED, _A.RESUME): _S.RUNNING,
        (_S.PAUSED, _A.ABORT): _S.ABORTED,
        (_S.PAUSED, _A.FAIL): _S.FAILED,
        (_S.PAUSED, _A.COMPLETE): _S.COMPLETED,
        (_S.FAILED, _A.RESUME): _S.RUNNING,
    }
)
"""Every allowed ``(state, action) -> new state``; anything else is refused."""

TERMINAL_STATES: frozenset[RunState] = frozenset(
    s for s in RunState if not any(k[0] is s and k[1] is not _A.RESUME for k in TRANSITIONS)
)
"""States where a run has ended: declined, cancelled, completed, aborted, failed (an
admin may still resume a failed run whose failure is recoverable)."""


class InvalidTransition(Exception):
    """An action that the run's current state does not allow."""

    def __init__(self, state: RunState, action: RunAction) -> None:
        self.state = state
        self.action = action
        allowed = ", ".join(a.value for a in allowed_actions(state)) or "none"
        super().__init__(f"cannot {action.value} a run that is {state.value} (allowed: {allowed})")


def allowed_actions(state: RunState) -> tuple[RunAction, ...]:
    """The actions ``state`` allows, in declaration order."""
    return tuple(a for a in RunAction if (state, a) in TRANSITIONS)


def next_state(state: RunState | str, action: RunAction | str) -> RunState:
    """The state after ``action``; :class:`InvalidTransition` if it is not allowed.

    Raises ValueError for a string that names no state or action.
    """
    s = RunState(state)
    a = RunAction(action)
    try:
        return TRANSITIONS[(s, a)]
    except KeyError:
        raise InvalidTransition(s, a) from None
