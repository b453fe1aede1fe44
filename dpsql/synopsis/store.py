"""Released synopses as signed JSON documents in the ledger, and the engine's view of them.

A build appends one document per release (``synopsis:<dataset>:<name>:<time>``, never overwritten: a
refresh is a new row), holding only what was released — each measured marginal's noisy values and its
public noise variance — with the public key domains and the measures' meaning. Nothing raw is stored.
The document is signed (HMAC-SHA-256 under the ledger's signing key, as result-cache entries are: see
:mod:`dpsql.ledger.signing`) so a row
written by anyone without that key is ignored; it is typed JSON, never pickle.

Which document serves a query: the newest one of a synopsis whose declaration (and its table's policy)
hashes to the policy's current one, on the same database (:mod:`dpsql.synopsis.current`; a continual
synopsis: all its periods). A changed declaration makes old releases unused (never misread); the
charge stays spent.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import math
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from dpsql.aggregates import MEASURES, Aggregate
from dpsql.errors import InternalError
from dpsql.ledger import Ledger
from dpsql.noise.mechanisms import mechanism_named
from dpsql.policy import Policy, Scalar
from dpsql.postprocess.finish import released_at
from dpsql.synopsis.grains import time_columns
from dpsql.synopsis.solve import Marginal, Totals, solve

_MAC_CONTEXT = b"dpsql synopsis v1"


def prefix(dataset: str, name: str | None = None) -> str:
    return f"synopsis:{dataset}:" + (f"{name}:" if name is not None else "")


def declaration_hash(policy: Policy, name: str) -> str:
    """The synopsis's declaration and its table's policy (bounds, caps, domains): what its release means.
    A continual synopsis's time columns leave their upper bound out: it grows as periods are appended,
    and the periods released before keep their meaning."""
    synopsis = policy.synopses[name]
    table = policy.table(synopsis.table)
    assert table is not None
    table_doc = table.model_dump(mode="json")
    if synopsis.continual:
        for column in time_columns(synopsis.keys):
            table_doc["columns"].get(column, {}).pop("upper", None)
    text = json.dumps([synopsis.model_dump(mode="json"), table_doc], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def encode_value(value: Scalar) -> Any:
    """A key value as JSON, its type kept (a date is not a string)."""
    if isinstance(value, dt.datetime):
        return {"ts": value.isoformat()}
    if isinstance(value, dt.date):
        return {"d": value.isoformat()}
    return value


def decode_value(value: Any) -> Scalar:
    if isinstance(value, dict):
        if "ts" in value:
            return dt.datetime.fromisoformat(value["ts"])
        return dt.date.fromisoformat(value["d"])
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    raise ValueError(f"not a key value: {value!r}")


@dataclass(frozen=True)
class SynopsisKey:
    """One key of the cube: ``kind`` plain (a column), trunc (``DATE_TRUNC(unit, column)``) or expr (any
    other expression, matched by its text ``text``)."""

    text: str
    kind: str
    column: str | None
    unit: str | None
    type: str
    domain: tuple[Scalar, ...]


@dataclass(frozen=True)
class SynopsisMeasure:
    """``count_star``, or ``sum`` of ``column`` clamped to its declared bounds, minus ``centre`` per row.
    ``kind`` is stored; its registered aggregate (``aggregate``: asked, never the kind) is resolved once,
    when the measure is made or loaded, and an unregistered kind is a loud error, never misread."""

    kind: str
    column: str | None
    centre: float = 0.0
    aggregate: Aggregate = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in MEASURES:
            raise InternalError(
                f"a stored synopsis release measures {self.kind!r}, which this dpsql does not register",
                hint="open it with the dpsql version that built it, or build the synopsis again",
            )
        object.__setattr__(self, "aggregate", MEASURES[self.kind])


@dataclass(frozen=True)
class Released:
    """One stored release of a synopsis."""

    name: str
    dataset: str
    table: str
    declaration: str
    identity: str
    built_at: float
    epsilon: float
    delta: float
    keys: tuple[SynopsisKey, ...]
    measures: tuple[SynopsisMeasure, ...]
    #: Per measure, the marginals measured (the same axes for every measure).
    marginals: tuple[tuple[Marginal, ...], ...]
    #: The registered noise mechanism that drew its noise, by name (its intervals ask it: ``sum_quantile``).
    mechanism: str
    #: Which release of the synopsis this is (1, 2, …; 0 before generations were numbered) and the ledger
    #: fingerprint of the charge that paid for it (:mod:`dpsql.curator.synopsis_cli`).
    generation: int = 0
    charge: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def __post_init__(self) -> None:
        try:
            mechanism_named(self.mechanism)
        except ValueError as exc:
            raise InternalError(
                f"a stored synopsis release: {exc}", hint="open it with the dpsql version that built it"
            ) from None

    @property
    def mechanisms(self) -> frozenset[str]:
        """The mechanisms whose noise is in it (a stitched series: every piece's)."""
        return frozenset((self.mechanism,))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(k.domain) for k in self.keys)

    @property
    def cells(self) -> int:
        return math.prod(self.shape)

    @property
    def axes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(m.axes for m in self.marginals[0])

    @cached_property
    def estimates(self) -> tuple[Totals, ...]:
        """The consistent cube of each measure (solved once per loaded release)."""
        with self._lock:
            return tuple(solve(self.shape, marginals) for marginals in self.marginals)

    def document(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dataset": self.dataset,
            "table": self.table,
            "declaration": self.declaration,
            "identity": self.identity,
            "built_at": self.built_at,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "keys": [
                {
                    "text": k.text,
                    "kind": k.kind,
                    "column": k.column,
                    "unit": k.unit,
                    "type": k.type,
                    "domain": [encode_value(v) for v in k.domain],
                }
                for k in self.keys
            ],
            "mechanism": self.mechanism,
            "generation": self.generation,
            "charge": self.charge,
            "measures": [{"kind": m.kind, "column": m.column, "centre": m.centre} for m in self.measures],
            "marginals": [
                [{"axes": list(m.axes), "values": list(m.values), "variance": m.variance} for m in per_measure]
                for per_measure in self.marginals
            ],
        }

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> Released:
        return cls(
            name=str(doc["name"]),
            dataset=str(doc["dataset"]),
            table=str(doc["table"]),
            declaration=str(doc["declaration"]),
            identity=str(doc["identity"]),
            built_at=float(doc["built_at"]),
            epsilon=float(doc["epsilon"]),
            delta=float(doc["delta"]),
            keys=tuple(
                SynopsisKey(
                    str(k["text"]),
                    str(k["kind"]),
                    k["column"],
                    k["unit"],
                    str(k["type"]),
                    tuple(decode_value(v) for v in k["domain"]),
                )
                for k in doc["keys"]
            ),
            measures=tuple(
                SynopsisMeasure(str(m["kind"]), m["column"], float(m.get("centre", 0.0))) for m in doc["measures"]
            ),
            marginals=tuple(tuple(_marginal(m) for m in per) for per in doc["marginals"]),
            mechanism=stored_mechanism(doc),
            generation=int(doc.get("generation", 0)),
            charge=str(doc.get("charge", "")),
        )

    @property
    def released_at(self) -> str:
        return released_at(self.built_at)


def stored_mechanism(doc: dict[str, Any]) -> str:
    """The mechanism a stored document names. Documents of the earlier format (before issue #39) kept a
    ``laplace`` flag instead: True (or no flag: the format before the flag, Laplace only) is ``laplace``,
    False ``gaussian``. A name this dpsql does not register fails loudly (:class:`Released`)."""
    if "mechanism" in doc:
        return str(doc["mechanism"])
    return "laplace" if doc.get("laplace", True) else "gaussian"


def _marginal(doc: dict[str, Any]) -> Marginal:
    return Marginal(tuple(int(a) for a in doc["axes"]), [float(v) for v in doc["values"]], float(doc["variance"]))


def _mac(installation_key: bytes, body: bytes) -> str:
    mac_key = hmac.new(installation_key, _MAC_CONTEXT, hashlib.sha256).digest()
    return hmac.new(mac_key, body, hashlib.sha256).hexdigest()


def seal(released: Released, installation_key: bytes) -> str:
    body = json.dumps(released.document(), sort_keys=True, separators=(",", ":"))
    return json.dumps({"mac": _mac(installation_key, body.encode()), "body": body})


def unseal(text: str, installation_key: bytes) -> Released | None:
    """The release in a stored document, or None when it is not one this installation signed."""
    try:
        outer = json.loads(text)
        body = outer["body"]
        if not hmac.compare_digest(str(outer["mac"]), _mac(installation_key, body.encode())):
            return None
        return Released.from_document(json.loads(body))
    except (ValueError, KeyError, TypeError):
        return None


def release_key(dataset: str, name: str, generation: int) -> str:
    """Where generation ``generation`` of a synopsis is stored: one key per generation, so at most one
    release is ever stored for it (``g`` sorts after the time-stamped keys of older versions: newer)."""
    return prefix(dataset, name) + f"g{generation:08d}"


def store(ledger: Ledger, released: Released) -> str:
    """Append ``released`` to the ledger (under its generation's key when it has one); its key."""
    if released.generation:
        key = release_key(released.dataset, released.name, released.generation)
    else:
        key = prefix(released.dataset, released.name) + f"{int(released.built_at * 1e6):020d}"
    ledger.add_synopsis(key, seal(released, ledger.signing_key()))
    return key
