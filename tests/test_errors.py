"""The SQLSTATE registry: one class per code, and its PEP 249 base follows the code's class."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpsql import errors
from dpsql.errors import PEP249_BASES, Error, lookup, registry

PACKAGE = Path(errors.__file__).parent


def test_every_registered_code_has_one_class_with_the_right_pep249_base() -> None:
    codes = registry()
    assert len(codes) > 40
    for code, cls in codes.items():
        assert re.fullmatch(r"[0-9A-Z]{5}", code), code
        assert cls.sqlstate == code and lookup(code) is cls
        assert issubclass(cls, PEP249_BASES[code[:2]]), (code, cls.__name__)
        assert cls.__module__ == "dpsql.errors"  # the whole catalogue is one file
    # subclasses without a code of their own keep their parent's code and base
    for cls in (errors.CatalogUnavailable, errors.AuthFailed, errors.ScramProtocolError):
        assert issubclass(cls, PEP249_BASES[cls.sqlstate[:2]])


@pytest.mark.parametrize(
    ("code", "base"),
    [
        ("42712", errors.ProgrammingError),
        ("42P10", errors.ProgrammingError),
        ("22012", errors.DataError),
        ("53300", errors.OperationalError),
        ("57014", errors.OperationalError),
        ("58P02", errors.OperationalError),
        ("0A000", errors.NotSupportedError),
        ("XX000", errors.InternalError),
    ],
)
def test_psycopg_style_bases(code: str, base: type[Error]) -> None:
    assert issubclass(lookup(code), base)


def test_a_code_cannot_be_registered_twice() -> None:
    with pytest.raises(TypeError, match="already"):

        class Again(errors.DataError, code="22012"):
            pass


def test_legacy_sqlstate_keyword_builds_the_registered_class() -> None:
    message = "GROUP BY position 3 is not in select list"
    exc: errors.Error = errors.InvalidParameterValue(message, sqlstate="42P10", hint="h")
    assert type(exc) is errors.InvalidColumnReference and exc.sqlstate == "42P10" and exc.hint == "h"
    exc = errors.FeatureNotSupported('table name "p" specified more than once', sqlstate="42712")
    assert isinstance(exc, errors.ProgrammingError) and not isinstance(exc, errors.NotSupportedError)
    assert type(errors.DataError("division by zero", sqlstate="22012")) is errors.DivisionByZero


def test_relayed_codes_keep_their_code_under_the_right_base() -> None:
    assert type(errors.relay("42P01", "no such table")) is errors.UndefinedTable
    other = errors.relay("22P05", "untranslatable character", detail="d")
    assert type(other) is errors.DataError and other.sqlstate == "22P05" and other.detail == "d"


def test_front_doors_pick_no_sqlstate_by_keyword() -> None:
    owned = [
        PACKAGE / "dbapi.py",
        PACKAGE / "session.py",
        PACKAGE / "cli.py",
        *sorted((PACKAGE / "server").glob("*.py")),
    ]
    offenders = [
        f"{p.name}:{i}" for p in owned for i, line in enumerate(p.read_text().splitlines(), 1) if "sqlstate=" in line
    ]
    assert offenders == []
