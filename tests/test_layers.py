"""The import-layer contract holds (scripts/check_layers.py, issue #30), and the checker itself sees what it claims."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import check_layers  # noqa: E402


def test_package_has_no_layer_violation() -> None:
    assert check_layers.violations() == []


def test_importing_errors_loads_nothing_else() -> None:
    """``import dpsql.errors`` must not pull in the engine, numpy, DuckDB or sqlglot (the facade is lazy)."""
    code = (
        "import sys, dpsql.errors; "
        "print(sorted(m for m in sys.modules if m.startswith('dpsql')), "
        "[m for m in ('numpy', 'duckdb', 'sqlglot') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['dpsql', 'dpsql.errors', 'dpsql.version'] []"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "dpsql" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # an upward import: errors (base) imports the engine
        ({"__init__.py": "", "errors.py": "import dpsql.engine\n", "engine.py": ""}, "higher stage engine"),
        # a cycle inside one stage
        (
            {
                "__init__.py": "",
                "rewrite/__init__.py": "",
                "rewrite/a.py": "from dpsql.rewrite import b\n",
                "rewrite/b.py": "from dpsql.rewrite import a\n",
            },
            "import cycle: dpsql.rewrite.a -> dpsql.rewrite.b",
        ),
        # a package cycle no module cycle shows (issue #39: curator ⇄ server through different modules)
        (
            {
                "__init__.py": "",
                "curator/__init__.py": "",
                "curator/a.py": "from dpsql.server import c\n",
                "curator/b.py": "",
                "server/__init__.py": "",
                "server/c.py": "",
                "server/d.py": "from dpsql.curator import b\n",
            },
            "package import cycle: dpsql.curator -> dpsql.server",
        ),
        # a hidden import inside a function
        ({"__init__.py": "", "engine.py": "def f():\n    import json\n"}, "import of json inside a function"),
        # a module in no stage
        ({"__init__.py": "", "stray.py": ""}, "dpsql.stray: in no stage"),
        # a module over 700 lines, a function over 80 (issue #39)
        ({"__init__.py": "", "engine.py": "x = 1\n" * 701}, "dpsql/engine.py: 701 lines"),
        ({"__init__.py": "", "engine.py": "def f():\n" + "    x = 1\n" * 80}, "function f has 81 lines"),
        # a charge outside the one charge path (issue #39)
        (
            {"__init__.py": "", "curator/__init__.py": "", "curator/x.py": "def f(ledger):\n    ledger.reserve()\n"},
            "dpsql/curator/x.py:2: .reserve( outside",
        ),
    ],
)
def test_checker_reports(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    problems = check_layers.violations(_package(tmp_path, files))
    assert any(expected in problem for problem in problems), problems


def test_checker_allows_the_size_caps_exactly(tmp_path: Path) -> None:
    files = {"__init__.py": "", "engine.py": "def f():\n" + "    x = 1\n" * 79 + "y = 2\n" * 620}
    assert check_layers.violations(_package(tmp_path, files)) == []


def test_checker_allows_typing_only_and_optional_stacks(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "errors.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dpsql.engine\n",
        "engine.py": "import dpsql.errors\ndef f():\n    import pyspark\n",
    }
    assert check_layers.violations(_package(tmp_path, files)) == []
