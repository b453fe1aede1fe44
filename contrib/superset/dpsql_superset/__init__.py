"""Apache Superset support for dpsql: the ``dpsql`` SQLAlchemy dialect and ``DpsqlEngineSpec``.

Nothing is imported here: SQLAlchemy and Superset load ``dialect`` and ``engine_spec`` through their
entry points, and the dialect must stay importable without Superset (plain SQLAlchemy clients).
"""

__version__ = "0.1.0"
