"""Real BI tools (Apache Superset) against `dpsql serve`; optional, marker ``bi``."""
