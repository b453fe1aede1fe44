"""No Python is ever built from a statement and run: dpsql's own code calls no eval/exec/compile, no
``__import__``, and never imports sqlglot's executor (which generates Python from SQL and evals it:
issue #26, where a quoted EXTRACT unit in a query over ``dpsql_budget`` ran code in the server).

Ruff's S102/S307 and the banned-api list in pyproject.toml say the same at lint time; this test walks
the syntax tree of every module, so it also catches ``compile(``, ``__import__`` and ``getattr(builtins,
"eval")`` that no lint rule names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DPSQL = Path(__file__).resolve().parents[2] / "dpsql"
#: Builtins that turn text into running code.
CODE_BUILTINS = frozenset({"eval", "exec", "compile", "__import__"})
EXECUTOR = "sqlglot.executor"
FINE_IMPORTS = ("import sqlglot", "import builtins")


def _is_executor(module: str) -> bool:
    return module == EXECUTOR or module.startswith(EXECUTOR + ".")


def findings(source: str, filename: str = "<source>") -> list[str]:
    """Each use of a code-running builtin or of sqlglot's executor in ``source``, as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        line = getattr(node, "lineno", 0)
        what = None
        if isinstance(node, ast.Name) and node.id in CODE_BUILTINS:  # called, or passed on to be called
            what = node.id
        elif isinstance(node, ast.Attribute) and node.attr == "__import__":
            what = "__import__"
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in CODE_BUILTINS
            and isinstance(node.value, ast.Name)
            and node.value.id in ("builtins", "__builtins__")
        ):
            what = f"builtins.{node.attr}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in CODE_BUILTINS
        ):
            what = f"getattr(…, {node.args[1].value!r})"
        elif isinstance(node, ast.Import) and any(_is_executor(alias.name) for alias in node.names):
            what = f"import {EXECUTOR}"
        elif isinstance(node, ast.ImportFrom) and (
            _is_executor(node.module or "")
            or (node.module == "sqlglot" and any(alias.name == "executor" for alias in node.names))
        ):
            what = f"import from {EXECUTOR}"
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "executor"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sqlglot"
        ):
            what = EXECUTOR
        if what is not None:
            found.append(f"{filename}:{line}: {what}")
    return found


@pytest.mark.unit
def test_dpsql_runs_no_generated_code() -> None:
    """no-codegen: no module of dpsql/ calls eval/exec/compile/__import__ or imports sqlglot's executor."""
    modules = sorted(DPSQL.rglob("*.py"))
    assert len(modules) > 50  # the whole package is walked
    found = [f for path in modules for f in findings(path.read_text(encoding="utf-8"), str(path.relative_to(DPSQL)))]
    assert found == []


@pytest.mark.unit
def test_the_walk_finds_each_form() -> None:
    """The checker itself: every forbidden form is found, look-alikes (re.compile, cursor.execute) are not."""
    bad = """
import sqlglot.executor
from sqlglot.executor import execute
from sqlglot.executor.python import PythonExecutor
from sqlglot import executor
import sqlglot
import builtins
sqlglot.executor.execute("SELECT 1")
eval("1")
exec("x = 1")
compile("1", "<s>", "eval")
__import__("os")
builtins.eval("1")
getattr(builtins, "exec")("x = 1")
"""
    found = {int(f.split(":")[1]) for f in findings(bad)}
    expected = {n for n, line in enumerate(bad.splitlines(), 1) if line and line not in FINE_IMPORTS}
    assert found == expected
    fine = """
import re
re.compile("x")
cursor.execute("SELECT 1")
engine.execute(sql, session)
sqlglot.parse_one(sql).sql()
"""
    assert findings(fine) == []
