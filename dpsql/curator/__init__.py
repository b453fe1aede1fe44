"""The curator's tools: draft a policy from a schema, check a policy against its database, reload it live.

Everything here runs for the operator (the data's owner), never for an analyst: what it reads from the
database (schema, a few distinct values when drafting) goes to the curator's terminal or the server's
log, never into an answer.
"""
