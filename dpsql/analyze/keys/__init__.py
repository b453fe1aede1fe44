"""GROUP BY key functions, one handler per sqlglot expression class.

Each module holds the handlers of one family (dates, date_bin, numbers, casts, CASE/COALESCE and
predicates, columns) over the shared :mod:`dpsql.analyze.keys.base`; the one table mapping
expression classes to handlers, and the refusal of every other class, are in
:mod:`dpsql.analyze.domains`. Adding a key function is one handler here plus one line there.
"""
