"""A cached result keeps each notice's kind, severity and SQLSTATE as made (issue #39 item 4): read back,
nothing is recovered from the text; entries written before (notices as bare text) still load."""

from __future__ import annotations

import json

import pytest

from dpsql.cache import UnusableEntry, dump_result, load_result
from dpsql.notices import Notice, NoticeKind, Severity
from dpsql.postprocess.finish import from_cache
from dpsql.session import OutputColumn, Result

KEY = "k" * 64
CHARGE = Notice('dpsql: charged ε=1; remaining ε=9 for analyst "alice"', NoticeKind.CHARGE)
#: A note whose text happens to say "charged": typed by its text it would pass for a budget notice.
NOTE = Notice("dpsql: the cap charged to each group is public", NoticeKind.NOTE)
WARNING = Notice("dpsql: WARNING: a tiny group", NoticeKind.NOTE, Severity.WARNING, "01000")


def _result(notices: list[str]) -> Result:
    return Result(
        columns=[OutputColumn("n", "bigint", True)],
        rows=[(3,)],
        accuracy=[(2.0,)],
        epsilon_spent=1.0,
        delta_spent=0.0,
        notices=notices,
    )


def _kinds(result: Result) -> list[tuple[str, NoticeKind, Severity, str]]:
    return [(str(n), n.kind, n.severity, n.sqlstate) for n in result.notices if isinstance(n, Notice)]


def test_notice_kinds_are_stored_not_recovered_from_the_text() -> None:
    made = _result([CHARGE, NOTE, WARNING])
    back, _ = load_result(KEY, dump_result(KEY, made, 1.0))
    assert len(back.notices) == 3
    assert _kinds(back) == _kinds(made)
    assert Notice.of(back.notices[1]).kind is NoticeKind.NOTE  # by its text it would be a budget notice
    again = from_cache(back, 1.0)  # served again: its budget notices (by kind) give way to the cache's
    assert [n.kind for n in again.notices if isinstance(n, Notice)] == [
        NoticeKind.FREE,
        NoticeKind.NOTE,
        NoticeKind.NOTE,
    ]
    assert again.notices[1:] == [NOTE, WARNING]


def test_an_entry_of_the_earlier_format_still_loads() -> None:
    """Notices stored as bare text (before the kinds were stored) are typed from the text, as they were."""
    document = json.loads(dump_result(KEY, _result([CHARGE, WARNING]), 1.0))
    document["notices"] = [str(CHARGE), str(WARNING)]
    back, _ = load_result(KEY, json.dumps(document, separators=(",", ":")).encode())
    assert [(n.kind, n.severity) for n in back.notices if isinstance(n, Notice)] == [
        (NoticeKind.CHARGE, Severity.NOTICE),
        (NoticeKind.NOTE, Severity.WARNING),
    ]


@pytest.mark.parametrize(
    "item",
    [
        ["text", "bogus", "NOTICE", "00000"],
        ["text", "note", "PANIC", "00000"],
        ["text", "note"],
        [1, "note", "NOTICE", ""],
    ],
)
def test_a_malformed_stored_notice_is_unusable(item: list[object]) -> None:
    document = json.loads(dump_result(KEY, _result([NOTE]), 1.0))
    document["notices"] = [item]
    with pytest.raises(UnusableEntry):
        load_result(KEY, json.dumps(document, separators=(",", ":")).encode())
