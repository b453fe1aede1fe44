"""``dpsql dashboard``: the data curator's web view of the privacy ledger.

Pages: the analysts' budgets (spent / total / remaining ε as bars, δ, frozen, the dataset's
total), ε spent over time per analyst (an SVG plot of the charges), the audit trail with filters
(analyst, since, outcome) and the policy (tables, columns, bounds, units, domains). A form applies
the curator's levers (grant, freeze, unfreeze) as the same append-only, audited ledger rows as
``dpsql budget grant|freeze|unfreeze``.

Privacy argument: the dashboard opens the ledger and the policy, never the data, so nothing it
shows can depend on one person's record beyond what the ledger already holds (the charges, which
depend on the queries only, and the audit rows, curator-only by design: see :mod:`dpsql.ledger.audit`).
It is the curator's: every page needs the curator's password (:mod:`dpsql.dashboard.auth`); an
analyst who reaches the port gets the login page and nothing else (:mod:`dpsql.dashboard.server`).
The pages are :mod:`dpsql.dashboard.pages`; the command, :mod:`dpsql.dashboard.cli`.
"""
