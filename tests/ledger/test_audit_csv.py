"""Round 3 of the ledger audit, item D: ``dpsql audit --csv`` escapes control and bidi characters as the
text table does, and no cell a spreadsheet would run as a formula starts the way it was written.

A real SQLite ledger and a real ``dpsql audit`` subprocess.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import os
import subprocess
import sys
from pathlib import Path

from dpsql.ledger import AuditEntry, Ledger
from dpsql.ledger.audit_report import AUDIT_COLUMNS, as_csv, csv_cell

ROOT = Path(__file__).resolve().parents[2]
EVIL_NAME = "ev\x1b[2J\x1b[31mil\u202e\r\n\x07"
EVIL_SHAPE = "SELECT \x1b]0;pwn\x07 FROM t\r\nFAKE ROW"


def test_csv_cells_are_escaped_and_defused() -> None:
    assert csv_cell(EVIL_NAME) == "ev\\x1b[2J\\x1b[31mil\\u202e\\x0d\\x0a\\x07"
    assert csv_cell('=HYPERLINK("http://x")') == '\'=HYPERLINK("http://x")'
    for start in "=+-@":
        assert csv_cell(f"{start}1+1").startswith("'")
    assert csv_cell("alice") == "alice" and csv_cell(0.5) == 0.5 and csv_cell(-1.0) == -1.0
    row = {"at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC), "analyst": "@evil", "shape": EVIL_SHAPE}
    text = as_csv([{**dict.fromkeys(AUDIT_COLUMNS), **row}])
    assert "\x1b" not in text and "\r" not in text and text.count("\n") == 2
    (parsed,) = list(csv.DictReader(io.StringIO(text)))
    assert parsed["analyst"] == "'@evil" and parsed["shape"] == "SELECT \\x1b]0;pwn\\x07 FROM t\\x0d\\x0aFAKE ROW"


def test_dpsql_audit_csv_writes_no_control_character(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'ledger.sqlite'}"
    with Ledger.open(url) as ledger:
        ledger.record_audit(
            [AuditEntry(dt.datetime.now(dt.UTC), "health", EVIL_NAME, "f" * 64, EVIL_SHAPE, "refused", "42501")]
        )
        ledger.record_audit(
            [AuditEntry(dt.datetime.now(dt.UTC), "health", "=cmd|' /C calc'!A0", "f" * 64, "-2+3", "refused", "42501")]
        )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpsql.cli",
            "audit",
            "--csv",
            "--ledger",
            url,
            "--policy",
            str(ROOT / "schemas" / "health.yaml"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DPSQL_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert not any(ch in done.stdout for ch in ("\x1b", "\x07", "\r", "\u202e")), repr(done.stdout)
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert {r["analyst"] for r in rows} == {"ev\\x1b[2J\\x1b[31mil\\u202e\\x0d\\x0a\\x07", "'=cmd|' /C calc'!A0"}
    assert "'-2+3" in {r["shape"] for r in rows}
