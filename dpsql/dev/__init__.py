"""Dev-only modules: the demo data (:mod:`.demo`), the seeds' differencing attack replayed
(:mod:`.attack`) and a throwaway PostgreSQL (:mod:`.local_postgres`), with the ``dpsql demo`` and
``dpsql demo-data`` commands (:mod:`.cli`).

None of them reads a curator's data or serves an analyst: they exist so that dpsql runs with no
setup (``dpsql serve`` on the demo) and so that tests and benchmarks have data and a database.
They sit below the front stage because two front doors use them: ``dpsql serve`` without
``--database`` loads the demo data, and without ``--catalog-dsn`` the server starts its shadow
catalog on a local PostgreSQL.
"""
