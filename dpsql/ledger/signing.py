"""The key that signs what the ledger's writer must not be able to forge: the composed PLD state of
``pld`` accounting (:mod:`dpsql.ledger.loss_state`) and released synopses (:mod:`dpsql.synopsis.store`).

On a PostgreSQL ledger the server connects as a writer role that may read ``dpsql_ledger_meta`` (the
installation key is there), so a key derived from it would let anyone holding the writer's credentials
sign a PLD state that gives budget back, or a synopsis of invented values. The signing key is therefore
kept *outside* the database: the file named by ``$DPSQL_SIGNING_KEY_FILE``, else ``signing-key`` in
``$DPSQL_HOME``, 32 random bytes in hex created with mode 0600 on first use. Every process and host
sharing one PostgreSQL ledger must be given the same file (as the same ``--ledger`` is).

A SQLite ledger has no roles (whoever can write its file can rewrite anything), so its signing key
is the installation key in the file, as before.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from dpsql.ledger.store import unavailable

#: Names the signing key's file (default: ``signing-key`` in ``$DPSQL_HOME``).
SIGNING_KEY_ENV = "DPSQL_SIGNING_KEY_FILE"


def signing_key_path(home: Path) -> Path:
    return Path(os.environ.get(SIGNING_KEY_ENV) or home / "signing-key")


def read_signing_key(path: Path) -> bytes:
    """The key in ``path``, created (mode 0600, never overwritten: a racing process's key wins) when missing.
    Fails closed (:class:`~dpsql.errors.LedgerUnavailable`) when it cannot be read or is not 32+ hex bytes."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32) + "\n")
    try:
        key = bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as exc:
        raise unavailable(f"cannot read the signing key {str(path)!r}", exc) from exc
    if len(key) < 32:
        raise unavailable(f"the signing key {str(path)!r} is shorter than 32 bytes")
    return key
