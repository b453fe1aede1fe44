"""``dpsql demo`` (the seeds' differencing attack on Igor, replayed) and ``dpsql demo-data`` (the demo
tables loaded into a database), registered on ``dpsql``'s parser."""

from __future__ import annotations

import argparse
import json

from dpsql.backends import open_backend

from .attack import differencing_attack
from .demo import load_demo


def cmd_demo(args: argparse.Namespace) -> int:
    """Replay the seeds' differencing attack on Igor, first on raw SQL, then through dpsql."""
    report = differencing_attack(runs=args.runs, epsilon=args.epsilon or 1.0)
    if args.json:
        print(json.dumps(report))
        return 0
    print("The seeds' differencing attack: Igor is the only single white male in zip 2138.")
    print("  Q1: SELECT COUNT(*) FROM patients WHERE problem = 'Obesity'")
    print("  Q2: SELECT COUNT(*) FROM patients WHERE problem = 'Obesity' AND (ethnicity <> 'White'")
    print("      OR marital_status <> 'Single' OR sex <> 'Male' OR zip <> 2138)   -- everyone but Igor")
    print(f"Raw SQL: Q1 - Q2 = {report['raw_difference']} -> the attacker learns Igor has obesity, every time.")
    print(
        f"dpsql (ε={report['epsilon']:g} per query, {report['runs']} fresh attacks): the attacker guessed right "
        f"{report['success_rate']:.1%} of the time; DP caps it at e^ε/(1+e^ε) = {report['bound']:.1%}."
    )
    print(f"Sample noisy differences: {report['sample_differences']}")
    return 0


def cmd_demo_data(args: argparse.Namespace) -> int:
    backend = open_backend(args.database)
    try:
        load_demo(backend, args.dataset or ["health", "adult"])
    finally:
        backend.close()
    print(f"loaded demo data ({', '.join(args.dataset or ['health', 'adult'])})")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``dpsql demo`` and ``dpsql demo-data`` to the command parsers."""
    demo = sub.add_parser("demo", help="replay the seeds' differencing attack on Igor")
    demo.add_argument("--runs", type=int, default=1000)
    demo.add_argument("--epsilon", type=float)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=cmd_demo)

    data = sub.add_parser("demo-data", help="load the demo tables into a database")
    data.add_argument("--database", required=True)
    data.add_argument("--dataset", action="append", choices=["health", "adult", "clinic", "survey"])
    data.set_defaults(func=cmd_demo_data)
