"""Curator synopses (``synopses:`` in the policy): noisy views released once, charged once to the dataset,
answering every query they cover by post-processing (:mod:`~dpsql.synopsis.answer`), made consistent by
least squares (:mod:`~dpsql.synopsis.solve`), stored signed in the ledger (:mod:`~dpsql.synopsis.store`).
Built by ``dpsql synopsis build`` (:mod:`dpsql.curator.synopsis_cli`)."""

from dpsql.synopsis.answer import answer
from dpsql.synopsis.current import Synopses
from dpsql.synopsis.store import Released, store

__all__ = ["Released", "Synopses", "answer", "store"]
