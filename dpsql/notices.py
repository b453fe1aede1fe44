"""Notices: what a statement tells the analyst besides its rows, typed where the text is made.

A :class:`Notice` is its text (what the CLI prints and DB-API returns, byte for byte) with its kind
(the budget it charged, why it was free, or a note on the released values), severity and SQLSTATE;
the server sends the budget kinds first. Texts made as plain strings below the engine (accuracy notes,
post-processing, answers read back from the result cache) are typed by :meth:`Notice.of`.
"""

from __future__ import annotations

from enum import Enum, StrEnum

from dpsql.accountant import Cost, fmt
from dpsql.session import Result

__all__ = ["ALL_CACHED", "ALL_RELEASED", "LOCAL", "Notice", "NoticeKind", "Severity", "typed"]


class NoticeKind(Enum):
    """What a notice is about. The budget kinds (CHARGE, FREE) are sent first by the server."""

    CHARGE = "charge"  # the budget this statement spent and what is left
    FREE = "free"  # why nothing was charged: the result cache, randomized response, a schema probe
    NOTE = "note"  # about the released values: accuracy, post-processing, the series chosen


class Severity(StrEnum):
    NOTICE = "NOTICE"
    WARNING = "WARNING"


#: How a note of :mod:`dpsql.release.accuracy` marks itself a warning (a quantile of a tiny group).
_WARNING_MARK = "dpsql: WARNING: "


class Notice(str):
    """A notice: its text (what the CLI prints and DB-API returns, byte for byte) with its kind,
    severity and SQLSTATE typed. A ``str``, so the result cache and every caller reading text keep
    working; immutable."""

    kind: NoticeKind
    severity: Severity
    sqlstate: str

    def __new__(
        cls, text: str, kind: NoticeKind = NoticeKind.NOTE, severity: Severity = Severity.NOTICE, sqlstate: str = ""
    ) -> Notice:
        self = super().__new__(cls, text)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "severity", severity)
        object.__setattr__(self, "sqlstate", sqlstate or ("01000" if severity is Severity.WARNING else "00000"))
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Notice is immutable: cannot set {name}")

    def __reduce__(self) -> tuple[type[Notice], tuple[str, NoticeKind, Severity, str]]:
        return Notice, (str(self), self.kind, self.severity, self.sqlstate)

    @property
    def budget(self) -> bool:
        """Whether it says what the statement cost (charged, or why nothing was)."""
        return self.kind is not NoticeKind.NOTE

    @property
    def message(self) -> str:
        """The text as the server sends it: a warning's severity is its own field, not a marker."""
        return "dpsql: " + self.removeprefix(_WARNING_MARK) if self.severity is Severity.WARNING else str(self)

    @classmethod
    def of(cls, text: str) -> Notice:
        """A note produced as text below the engine (accuracy, post-processing, a stored answer) typed
        by its markers: a budget notice says "charged", a warning starts with ``dpsql: WARNING:``."""
        if isinstance(text, Notice):
            return text
        if "charged" in text:
            free = "no budget charged" in text or "nothing charged" in text
            return cls(text, NoticeKind.FREE if free else NoticeKind.CHARGE)
        if text.startswith(_WARNING_MARK):
            return cls(text, NoticeKind.NOTE, Severity.WARNING)
        return cls(text)

    @classmethod
    def charged(cls, cost: Cost, remaining_epsilon: float, analyst: str, queries: int | None = None) -> Notice:
        """What was charged (``queries``: for how many DP sub-queries of a composite) and what is left."""
        text = f"dpsql: charged ε={fmt(cost.epsilon)}" + (f", δ={fmt(cost.delta)}" if cost.delta else "")
        if queries is not None:
            text += f" for {queries} DP sub-quer{'y' if queries == 1 else 'ies'}"
        left = fmt(remaining_epsilon, down=True)  # never more than is left
        return cls(text + f'; remaining ε={left} for analyst "{analyst}"', NoticeKind.CHARGE)


ALL_CACHED = Notice("dpsql: every DP sub-query was answered from the result cache; no budget charged", NoticeKind.FREE)
ALL_RELEASED = Notice(
    "dpsql: every DP sub-query was answered from released values (the result cache, a synopsis or the cells of an "
    "earlier release); no budget charged",
    NoticeKind.FREE,
)
LOCAL = Notice("dpsql: randomized-response estimate from perturbed answers; no budget charged", NoticeKind.FREE)


def typed(result: Result) -> Result:
    """``result`` with every notice a :class:`Notice` (those made as text below the engine typed)."""
    result.notices = [Notice.of(n) for n in result.notices]
    return result
