"""The sensitivity fuzzer's world: a schema, its data, worst-case neighbours, random policies and queries.

A small person-level schema (``people`` is the unit table, ``events`` references it with many rows per
person and a free-text ``tag``, ``lines`` references events — the person two hops away, three with
households —, ``kinds`` is public) is loaded once per backend as the base database D and as D + one
adversarial person for each entry of :data:`ADVERSARIES`. Each adversary is a worst case the bounding
code must survive: many rows in one group, rows spread over every group (and a secret key nobody else
holds), NULLs next to values so a crossing cell's non-NULL count differs from its row count, and stored
values beyond every bound (±infinity, NaN, huge, out-of-range dates). Their tags are what WHERE's
narrowing of text domains must survive: one tag in every row (matched by some patterns, not others), every
declared tag and a secret one, NULL tags, and non-ASCII tags (accents, ß, a decomposed é, Ω) where ILIKE's
case folding differs between backends. Two attack the foreign-key chains: ``dupkey`` reuses another
person's event ids (a referenced key that repeats: that person's lines meet two events), ``adopter`` brings
the events that D's orphaned lines point at (rows that belong to nobody until it comes). ``visits`` is
row-level (no unit column: each row its own person); every adversary but ``dupkey`` brings one visit
beyond the bounds (1e9, NaN with a secret ward, all NULL, ±infinity, dates a century away).

Policies (:func:`policies`) vary ``max_rows_per_unit``, ``max_groups_per_unit``, bounds, domains and
nullability; queries (:func:`queries`) are drawn from the grammar dpsql accepts: every additive
aggregate (COUNT, COUNT(col), COUNT(DISTINCT unit), COUNT(DISTINCT col), SUM, AVG, VAR_POP, STDDEV, corr) with
and without FILTER/CASE, over division, casts and ``%`` too, plain and expression keys (DATE_TRUNC, EXTRACT,
FLOOR, CASE, width_bucket, date_bin, comparisons), joins along the reference and to the public table, WHERE (row
arithmetic included), and SELECT DISTINCT; queries over lines, alone or joined up the chain by foreign key
(:func:`line_queries`), and per-person subqueries grouped by the unit (:func:`person_queries`). WHERE mixes plain
predicates with the shapes that narrow a public key's domain (:data:`NARROWING_WHERE`: NOT IN lists, LIKE/ILIKE
with ``%``, ``_`` and escapes, OR-ed equalities and INs on one column), often on a grouped column, one or two
conjuncts. A case prints as a policy YAML plus
SQL, which is all it takes to reproduce it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from hypothesis import strategies as st

#: Columns that hold NULLs in the data: always declared nullable (a curator declaring NOT NULL on a
#: column with NULLs is a policy error `policy check` reports, not a bounding case).
NULLABLE_ALWAYS = {
    ("people", "grp"),
    ("people", "score"),
    ("events", "amount"),
    ("events", "qty"),
    ("events", "ts"),
    ("events", "tag"),
}

KINDS = ["a", "b", "c", "d"]
SECRET_KIND = "zz"  # held by one adversary only: never a public domain value
#: events.tag's declared domain: LIKE metacharacters as data (``_``, ``%``, a backslash), case pairs, and
#: non-ASCII values (É/é fold differently in each backend's ILIKE; "e\u0301" is é decomposed: two characters).
TAGS = ["alpha", "Alpha", "al_ha", "50%", "back\\slash", "é", "É", "straße", "e\u0301", "Ωmega"]
SECRET_TAG = "zeta"  # held by the spread adversary only

DDL = """
CREATE TABLE people (pid INTEGER, hh INTEGER, grp VARCHAR(8), age INTEGER, score DOUBLE PRECISION, born DATE);
CREATE TABLE events (eid INTEGER, pid INTEGER, kind VARCHAR(8), amount DOUBLE PRECISION, qty INTEGER,
                     day DATE, ts TIMESTAMP, flag BOOLEAN, tag VARCHAR(16));
CREATE TABLE kinds (name VARCHAR(8), cat VARCHAR(8));
CREATE TABLE lines (lid INTEGER, eid INTEGER, price DOUBLE PRECISION, color VARCHAR(8));
CREATE TABLE visits (vid INTEGER, ward VARCHAR(8), cost DOUBLE PRECISION, los INTEGER, day DATE);
"""

#: lines.color's declared domain; lines reach the person two hops away (lines → events → people).
COLORS = ["red", "blue"]
#: Lines in D whose event no one has (orphans: they belong to nobody until an event with this id exists,
#: which the ``adopter`` adversary brings); ids far from every person's events.
ORPHAN_EIDS = (99001, 99002)


def _lit(value: object) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, float):
        if value != value:
            return "CAST('NaN' AS DOUBLE PRECISION)"
        if value in (float("inf"), float("-inf")):
            return f"CAST('{'-' if value < 0 else ''}Infinity' AS DOUBLE PRECISION)"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


def _date(value: str | None) -> str:
    return "NULL" if value is None else f"DATE '{value}'"


def _ts(value: str | None) -> str:
    return "NULL" if value is None else f"TIMESTAMP '{value}'"


Event = tuple[str, float | None, int | None, str, str | None, bool]  # kind, amount, qty, day, ts, flag
Visit = tuple[str | None, float | None, int | None, str | None]  # ward, cost, los, day: one row-level visit
Tags = tuple[str | None, ...]  # one per event, cycled: a person's events' tags
Line = tuple[float | None, str | None]  # price, color
Lines = tuple[tuple[Line, ...], ...]  # per event (cycled): its lines


@dataclass(frozen=True)
class Person:
    pid: int
    hh: int  # household: the unit when the policy protects households (group privacy)
    grp: str | None
    age: int
    score: float | None
    born: str
    events: tuple[Event, ...]
    tags: Tags = (None,)
    lines: Lines = ((),)
    #: Event ids to use instead of fresh ones (the ``dupkey`` adversary reuses another person's event id,
    #: the ``adopter`` an orphaned line's), cycled over its events.
    eids: tuple[int, ...] = ()
    #: This person's one row of the row-level ``visits`` table (no unit column: each row is a person).
    visit: Visit | None = None


def _visit(vid: int, visit: Visit) -> str:
    ward, cost, los, day = visit
    return f"INSERT INTO visits VALUES ({vid}, {_lit(ward)}, {_lit(cost)}, {_lit(los)}, {_date(day)});\n"


def _base_visits(seed: int = 11, n: int = 60) -> list[Visit]:
    """D's row-level visits: each row one person, NULLs among the values."""
    rng = random.Random(seed)
    return [
        (
            None if rng.random() < 0.1 else rng.choice(KINDS),
            None if rng.random() < 0.15 else round(rng.uniform(-5, 60), 2),
            None if rng.random() < 0.1 else rng.randint(0, 14),
            None if rng.random() < 0.1 else f"2024-{rng.randint(1, 6):02d}-{rng.randint(1, 28):02d}",
        )
        for _ in range(n)
    ]


def _insert(person: Person, first_eid: int, first_lid: int = 0) -> str:
    sql = (
        f"INSERT INTO people VALUES ({person.pid}, {person.hh}, {_lit(person.grp)}, {person.age}, "
        f"{_lit(person.score)}, {_date(person.born)});\n"
    )
    lid = first_lid
    for j, (kind, amount, qty, day, ts, flag) in enumerate(person.events):
        tag = person.tags[j % len(person.tags)]
        eid = person.eids[j % len(person.eids)] if person.eids else first_eid + j
        sql += (
            f"INSERT INTO events VALUES ({eid}, {person.pid}, {_lit(kind)}, {_lit(amount)}, "
            f"{_lit(qty)}, {_date(day)}, {_ts(ts)}, {_lit(flag)}, {_lit(tag)});\n"
        )
        for price, color in person.lines[j % len(person.lines)]:
            sql += f"INSERT INTO lines VALUES ({lid}, {eid}, {_lit(price)}, {_lit(color)});\n"
            lid += 1
    return sql


def _base_people(seed: int = 7, n: int = 40) -> list[Person]:
    rng = random.Random(seed)
    tag_rng = random.Random(seed + 1)  # its own stream: the other columns stay as they were
    line_rng = random.Random(seed + 2)  # and the lines theirs
    people = []
    for pid in range(1, n + 1):
        events = []
        for _ in range(rng.randint(0, 5)):
            month, dom = rng.randint(1, 6), rng.randint(1, 28)
            events.append(
                (
                    rng.choice(KINDS),
                    None if rng.random() < 0.15 else round(rng.uniform(-5, 60), 2),
                    None if rng.random() < 0.15 else rng.randint(-2, 12),
                    f"2024-{month:02d}-{dom:02d}",
                    None if rng.random() < 0.1 else f"2024-{month:02d}-{dom:02d} {rng.randint(0, 23):02d}:30:00",
                    rng.random() < 0.5,
                )
            )
        people.append(
            Person(
                pid,
                (pid + 1) // 2,  # two people per household
                None if rng.random() < 0.1 else rng.choice(["a", "b", "c"]),
                rng.randint(0, 105),
                None if rng.random() < 0.1 else round(rng.uniform(-6, 6), 3),
                f"{rng.randint(1945, 2003)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                tuple(events),
                tuple(None if tag_rng.random() < 0.15 else tag_rng.choice(TAGS) for _ in range(max(1, len(events)))),
                tuple(
                    tuple(
                        (round(line_rng.uniform(0, 120), 1), line_rng.choice([*COLORS, None]))
                        for _ in range(line_rng.randint(0, 3))
                    )
                    for _ in range(max(1, len(events)))
                ),
            )
        )
    return people


def _heavy() -> Person:
    """Many rows in one group (kind 'a', one day), NULLs between values, values beyond every bound."""
    amounts = [None, 1e9, 41.0, None, 45.5, -3.0, float("nan"), 42.0, None, 60.0, 43.25, None, 44.0, 41.5]
    qtys = [None, 10, 100, None, 0, -7, 3, None, 9, 1, None, 5, 8, 9]
    events = [
        (
            "a",
            a,
            q,
            f"2024-02-{10 + i % 4:02d}",
            f"2024-02-{10 + i % 4:02d} 0{i % 3}:00:00" if i % 3 else None,
            i % 2 == 0,
        )
        for i, (a, q) in enumerate(zip(amounts, qtys, strict=True))
    ]
    many = tuple((float(10 + i), COLORS[i % 2]) for i in range(9))  # many lines of one event
    visit = ("a", 1e9, 100, "2024-02-10")  # a visit far above every cost bound
    return Person(1001, 1001, "a", 40, 1.0, "1980-01-01", tuple(events), ("alpha",), (many,), visit=visit)  # 'al%' yes


def _spread() -> Person:
    """Rows in every group: every kind (and a secret one), every month, both flags."""
    events = []
    for i in range(14):
        kind = [*KINDS, SECRET_KIND][i % 5]
        month = 1 + i % 6
        amount = None if i % 4 == 1 else [0.0, 50.0, 12.5, 49.99, 7.0][i % 5]
        events.append(
            (
                kind,
                amount,
                i % 11,
                f"2024-{month:02d}-{1 + i:02d}",
                f"2024-{month:02d}-{1 + i:02d} 12:00:00",
                i % 2 == 1,
            )
        )
    spread = ((5.0, "red"),), ((None, "blue"), (99.0, None)), ((1e9, "red"),)
    visit = (SECRET_KIND, float("nan"), None, "2024-06-30")  # a ward nobody else has, a NaN cost
    return Person(
        1002, 1002, "b", 101, -5.0, "1999-12-31", tuple(events), (*TAGS, SECRET_TAG, None), spread, visit=visit
    )


def _crossing() -> Person:
    """A few rows in each of a few groups, mostly NULL amounts: cells that cross ``max_rows`` with a
    non-NULL count below their row count (the centring count must scale like the sum)."""
    layout = [("b", 4), ("c", 3), ("d", 5), ("a", 2)]
    events = []
    for kind, n in layout:
        for j in range(n):
            amount = 50.0 if j == n - 1 else None
            qty = 10 if j % 2 == 0 else None
            events.append(
                (kind, amount, qty, f"2024-0{1 + j % 3}-15", None if j % 2 else "2024-03-01 00:00:00", j == 0)
            )
    visit = (None, None, None, None)  # a visit of NULLs: counted by COUNT(*), by no COUNT(column)
    return Person(1003, 1003, None, 0, None, "1950-01-01", tuple(events), (None, None, "al_ha"), visit=visit)


def _odd() -> Person:
    """Stored values far outside every bound: ±infinity, huge, dates decades away."""
    events = [
        ("c", float("inf"), 2_000_000_000, "2099-12-31", "1901-01-01 00:00:00", True),
        ("c", float("-inf"), -2_000_000_000, "1900-01-01", "2099-06-30 23:59:59", False),
        ("b", 1e300, 7, "2024-06-30", "2024-06-30 23:59:59", True),
        ("a", -1e300, None, "2024-01-01", None, False),
    ]
    odd = ((float("inf"), "red"), (float("-inf"), "blue"), (float("nan"), None), (-1e300, "red"))
    return Person(
        1004,
        1004,
        "c",
        1000,
        float("inf"),
        "1800-01-01",
        tuple(events),
        ("É", "straße", "e\u0301", "Ωmega"),
        (odd,),
        visit=("c", float("inf"), -2_000_000_000, "2099-12-31"),
    )


def _dupkey() -> Person:
    """Events whose ids are another person's (person 1's first event is eid 1): a key that repeats, so
    that person's lines meet two events; the copies must count as this adversary's, never theirs."""
    events = tuple(("b", 20.0, 3, "2024-03-03", "2024-03-03 10:00:00", True) for _ in range(3))
    lines = (((30.0, "red"), (31.0, "blue")),)
    return Person(1005, 1005, "a", 33, 0.5, "1990-05-05", events, ("alpha",), lines, eids=(1, 2))


def _adopter() -> Person:
    """Events with the ids of D's orphaned lines (:data:`ORPHAN_EIDS`): in D they belong to nobody, with
    this person they are theirs; they must move one unit, never two (nobody's and theirs)."""
    events = tuple(("c", 10.0, 1, "2024-04-04", "2024-04-04 09:00:00", False) for _ in ORPHAN_EIDS)
    visit = ("b", float("-inf"), 2_000_000_000, "1900-01-01")
    return Person(1006, 1006, "b", 44, 1.5, "1985-06-06", events, ("é",), ((),), eids=ORPHAN_EIDS, visit=visit)


#: Neighbours outside the policy's constraints: ``dupkey`` makes a declared key (events.eid, which lines
#: reference) repeat. No bound holds there (its lines would count for every owner of the id), so the
#: engine refuses queries through the key (dpsql.unit_keys, 23505) and ``policy check`` reports it:
#: tests/adversarial/test_multihop_neighbours.py. The sensitivity fuzzer checks the valid ones only.
INVALID = frozenset({"dupkey"})

ADVERSARIES: dict[str, Person] = {
    "heavy": _heavy(),
    "spread": _spread(),
    "crossing": _crossing(),
    "odd": _odd(),
    "dupkey": _dupkey(),
    "adopter": _adopter(),
}


def database_script(adversary: str | None) -> str:
    """DDL and rows of D (``adversary`` None) or of D plus one adversarial person."""
    script = DDL
    script += "".join(f"INSERT INTO kinds VALUES ('{k}', '{'x' if k in 'ab' else 'y'}');\n" for k in KINDS)
    eid, lid = 1, 1
    people = _base_people()
    if adversary is not None:
        people.append(ADVERSARIES[adversary])
    for person in people:
        script += _insert(person, eid, lid)
        lid += sum(len(person.lines[j % len(person.lines)]) for j in range(len(person.events)))
        eid += len(person.events) if not person.eids else 0
    visits = _base_visits() + [p.visit for p in people if p.visit is not None]
    script += "".join(_visit(vid, visit) for vid, visit in enumerate(visits, start=1))
    for i, orphan in enumerate(ORPHAN_EIDS):  # lines of events nobody has
        script += f"INSERT INTO lines VALUES ({90000 + 2 * i}, {orphan}, 25.0, 'red');\n"
        script += f"INSERT INTO lines VALUES ({90001 + 2 * i}, {orphan}, 75.0, 'blue');\n"
    return script


# -- policies -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzPolicy:
    unit: str  # "pid" (a person) or "hh" (a household, reached by events through people)
    max_rows: int
    max_groups: int
    kind_domain: str  # "table" | "list" | "none"
    grp_domain: bool
    nullable: frozenset[tuple[str, str]]
    amount_bounds: tuple[float, float]
    qty_bounds: tuple[int, int]
    score_bounds: tuple[float, float]
    tag_domain: bool = True
    lines_rows: int = 3  # lines.max_rows_per_unit (lines reach the unit two or three hops away)

    def yaml(self) -> str:
        def null(table: str, column: str) -> str:
            return "true" if (table, column) in self.nullable else "false"

        kind_domain = {
            "table": ", domain: {table: kinds, column: name}",
            "list": ", domain: [" + ", ".join(KINDS) + "]",
            "none": "",
        }[self.kind_domain]
        grp_domain = ", domain: [a, b, c]" if self.grp_domain else ""
        tag_domain = ", domain: [" + ", ".join(json.dumps(t) for t in TAGS) + "]" if self.tag_domain else ""
        lo, hi = self.amount_bounds
        qlo, qhi = self.qty_bounds
        slo, shi = self.score_bounds
        return f"""dataset: fuzz
defaults: {{epsilon: 1.0, delta: 1.0e-6, mechanism: laplace, confidence: 0.95}}
budget:
  dataset: {{epsilon: 1000.0, delta: 1.0e-3}}
  analyst: {{epsilon: 1000.0, delta: 1.0e-3}}
auth: {{trust: true}}
analysts:
  - name: alice
tables:
  people:
    privacy_unit: {self.unit}
    max_rows_per_unit: {1 if self.unit == "pid" else 2}
    columns:
      pid: {{type: int, identifier: true}}
      hh: {{type: int, identifier: true}}
      grp: {{type: text, nullable: {null("people", "grp")}{grp_domain}}}
      age: {{type: int, lower: 0, upper: 100, nullable: {null("people", "age")}}}
      score: {{type: float, lower: {slo}, upper: {shi}, nullable: {null("people", "score")}}}
      born: {{type: date, lower: 1940-01-01, upper: 2005-12-31, nullable: {null("people", "born")}}}
  events:
    references: {{column: pid, table: people, to: pid}}
    max_rows_per_unit: {self.max_rows}
    max_groups_per_unit: {self.max_groups}
    columns:
      eid: {{type: int, identifier: true}}
      pid: {{type: int, identifier: true}}
      kind: {{type: text, nullable: {null("events", "kind")}{kind_domain}}}
      amount: {{type: float, lower: {lo}, upper: {hi}, nullable: {null("events", "amount")}}}
      qty: {{type: int, lower: {qlo}, upper: {qhi}, nullable: {null("events", "qty")}}}
      day: {{type: date, lower: 2024-01-01, upper: 2024-06-30, nullable: {null("events", "day")}}}
      ts: {{type: timestamp, lower: 2024-01-01 00:00:00, upper: 2024-06-30 23:59:59, nullable: {null("events", "ts")}}}
      flag: {{type: boolean, nullable: {null("events", "flag")}}}
      tag: {{type: text, nullable: {null("events", "tag")}{tag_domain}}}
  kinds:
    public: true
    columns:
      name: {{type: text, domain: [{", ".join(KINDS)}]}}
      cat: {{type: text, domain: [x, y]}}
  lines:
    references: {{column: eid, table: events, to: eid}}
    max_rows_per_unit: {self.lines_rows}
    columns:
      lid: {{type: int, identifier: true}}
      eid: {{type: int, identifier: true}}
      price: {{type: float, lower: 0.0, upper: 100.0, nullable: true}}
      color: {{type: text, domain: [{", ".join(COLORS)}], nullable: true}}
  visits:
    columns:
      vid: {{type: int, identifier: true}}
      ward: {{type: text, nullable: true{kind_domain}}}
      cost: {{type: float, lower: {lo}, upper: {hi}, nullable: true}}
      los: {{type: int, lower: 0, upper: 30, nullable: true}}
      day: {{type: date, lower: 2024-01-01, upper: 2024-06-30, nullable: true}}
"""


_OPTIONAL_NULLABLE = [("people", "age"), ("people", "born"), ("events", "kind"), ("events", "day"), ("events", "flag")]


@st.composite
def policies(draw: st.DrawFn) -> FuzzPolicy:
    """A random policy over the fuzz schema: small caps so crossing cells and group limits bite."""
    extra = draw(st.sets(st.sampled_from(_OPTIONAL_NULLABLE)))
    return FuzzPolicy(
        unit=draw(st.sampled_from(["pid", "pid", "hh"])),
        max_rows=draw(st.integers(1, 6)),
        max_groups=draw(st.integers(1, 4)),
        kind_domain=draw(st.sampled_from(["table", "list", "none"])),
        grp_domain=draw(st.booleans()),
        nullable=frozenset(NULLABLE_ALWAYS | extra),
        amount_bounds=draw(st.sampled_from([(0.0, 50.0), (-10.0, 40.0), (5.0, 45.0), (0.0, 1000.0)])),
        qty_bounds=draw(st.sampled_from([(0, 10), (-5, 5), (1, 8)])),
        score_bounds=draw(st.sampled_from([(-5.0, 5.0), (0.0, 3.0)])),
        tag_domain=draw(st.integers(0, 3)) > 0,
        lines_rows=draw(st.integers(1, 8)),
    )


# -- queries --------------------------------------------------------------------------------------

#: Group keys over events (alias e), people (p, through the reference) and kinds (k, public).
EVENT_KEYS = [
    "e.kind",
    "e.flag",
    "DATE_TRUNC('month', e.day)",
    "EXTRACT(month FROM e.day)",
    "EXTRACT(dow FROM e.day)",
    "FLOOR(e.amount / 10)",
    "FLOOR(e.amount * 10)",
    "CASE WHEN e.amount < 10 THEN 'lo' WHEN e.amount < 30 THEN 'mid' ELSE 'hi' END",
    "CASE WHEN e.kind IN ('a', 'b') THEN 'ab' ELSE 'other' END",
    "width_bucket(e.amount, 0, 50, 5)",
    "date_bin('7 days', e.ts, TIMESTAMP '2024-01-01')",
    "DATE_TRUNC('week', e.ts)",
    "e.qty",
    "e.qty > 5",
    "e.day",
    "e.tag",
    "CASE WHEN e.tag LIKE 'al%' THEN 'al' WHEN e.tag ILIKE '%E%' THEN 'e' ELSE 'other' END",
]
PEOPLE_KEYS = ["p.grp", "FLOOR(p.age / 10)", "p.age > 50", "EXTRACT(year FROM p.born)", "p.age"]
KIND_KEYS = ["k.cat"]

#: Aggregates over events, by family: a family is drawn first, so each bounding path is reached often.
EVENT_MEASURE_FAMILIES: dict[str, list[str]] = {
    "count": ["COUNT(*)", "COUNT(e.amount)", "COUNT(e.qty)", "COUNT(CASE WHEN e.amount > 25 THEN 1 END)"],
    "distinct": ["COUNT(DISTINCT e.pid)", "COUNT(DISTINCT e.kind)", "COUNT(DISTINCT e.day)", "COUNT(DISTINCT e.tag)"],
    "sum": ["SUM(e.amount)", "SUM(e.qty)", "AVG(e.amount)", "AVG(e.qty)"],
    "spread": ["VAR_POP(e.amount)", "VAR_SAMP(e.qty)", "STDDEV(e.amount)", "corr(e.amount, e.qty)"],
    "filtered": [
        "COUNT(*) FILTER (WHERE e.flag)",
        "SUM(e.amount) FILTER (WHERE e.qty > 3)",
        "AVG(e.amount) FILTER (WHERE e.kind = 'a')",
        "AVG(e.qty) FILTER (WHERE e.amount > 20)",
        "VAR_POP(e.amount) FILTER (WHERE e.flag)",
        "SUM(CASE WHEN e.flag THEN e.qty ELSE 0 END)",
        "SUM(CASE WHEN e.kind = 'b' THEN 1 END)",
        "COUNT(*) FILTER (WHERE e.tag LIKE '%a%')",
        "AVG(CASE WHEN e.flag THEN e.amount END)",
    ],
    # division, casts and % inside aggregates (#36): NULLIF'd divisors that can be 0 (qty), PostgreSQL's
    # truncating integer division, casts of doubles to integers (rint) and of booleans to 0/1
    "arith": [
        "SUM(e.amount / 1000.0)",
        "SUM(CAST(e.qty AS DOUBLE PRECISION))",
        "AVG(e.qty::float)",
        "SUM(e.qty / 3)",
        "SUM(e.amount / e.qty)",
        "AVG(e.qty / (e.qty - 2))",
        "SUM(e.qty % 4)",
        "AVG(CAST(e.amount AS INTEGER))",
        "SUM(CAST(e.flag AS INTEGER))",
        "SUM(e.amount * (1 - e.qty / 20.0))",
    ],
    "selected": [
        "MIN(e.amount)",
        "MAX(e.qty)",
        "percentile_cont(0.5) WITHIN GROUP (ORDER BY e.amount)",
        "percentile_disc(0.9) WITHIN GROUP (ORDER BY e.qty)",
        "mode() WITHIN GROUP (ORDER BY e.flag)",
    ],
}
EVENT_MEASURES = [m for family in EVENT_MEASURE_FAMILIES.values() for m in family]
PEOPLE_MEASURES = ["SUM(p.age)", "AVG(p.score)", "COUNT(DISTINCT p.pid)", "AVG(p.age)", "VAR_POP(p.score)"]
PEOPLE_ONLY_MEASURES = [m.replace("p.", "") for m in ["COUNT(*)", "COUNT(p.score)", *PEOPLE_MEASURES]]
PEOPLE_ONLY_KEYS = [k.replace("p.", "") for k in PEOPLE_KEYS]

EVENT_WHERE = [
    # subqueries by what they read (#36): the same person's rows (a semi- or anti-join tied along the
    # foreign key), a group of them (HAVING on clamped aggregates), and a public table
    "EXISTS (SELECT * FROM lines l WHERE l.eid = e.eid AND l.price > 20)",
    "NOT EXISTS (SELECT * FROM lines l WHERE l.eid = e.eid)",
    "e.eid IN (SELECT l.eid FROM lines l GROUP BY l.eid HAVING COUNT(*) > 1)",
    "e.kind IN (SELECT name FROM kinds WHERE cat = 'x')",
    "e.amount > 5",
    "e.kind IN ('a', 'b')",
    "e.flag",
    "e.day >= DATE '2024-03-01'",
    "e.qty BETWEEN 2 AND 8",
    "e.amount IS NULL",
    # row arithmetic (#36): every column clamped before the operation, divisors that can be 0 NULLIF'd,
    # constants folded as PostgreSQL would (0.06 - 0.01, INTERVAL '30' DAY (3))
    "e.amount + 1 > 20",
    "e.amount * (1 - 0.05) > 10",
    "e.qty / 2 > 1",
    "e.amount / e.qty > 3",
    "e.qty % 3 = 0",
    "CAST(e.amount AS INTEGER) = 42",
    "e.qty / (e.qty - 1) >= 1",
    "e.amount BETWEEN 0.06 - 0.01 AND 40 + 1",
    "e.day <= DATE '2024-06-30' - INTERVAL '30' DAY (3)",
    "EXTRACT(month FROM e.day) + 1 > 3",
    "e.amount - e.qty * 2 < e.amount / 2",
]
PEOPLE_WHERE = ["p.age < 60", "p.grp = 'a'", "p.score > 0", "p.age + 1 > 40", "p.score * 2 + p.age / 10 < 3"]

#: WHERE shapes that narrow a public key's domain (dpsql/analyze/keys/narrow.py), by the column they
#: narrow: NOT IN (a NULL in the list passes no row), LIKE/ILIKE with ``%``, ``_``, escaped ``_``/``%``/
#: backslash, non-ASCII patterns (ILIKE folds them differently per backend), a written ESCAPE and
#: ``lower(col)`` (refused / not narrowed), NOT LIKE, and OR-ed equalities/INs on one column (and ORs that
#: are not: another column, IS NULL). Every SQL string is as sent: ``\\`` here is one backslash in SQL.
NARROWING_WHERE: dict[str, list[str]] = {
    "e.kind": [
        "e.kind NOT IN ('a', 'b')",
        "e.kind NOT IN ('zz')",
        "NOT (e.kind IN ('c'))",
        "e.kind NOT IN ('a', NULL)",
        "e.kind LIKE 'a%'",
        "e.kind LIKE '_'",
        "e.kind ILIKE 'B'",
        "e.kind NOT LIKE 'a'",
        "e.kind = 'a' OR e.kind = 'c'",
        "e.kind = 'b' OR e.kind IN ('d', 'zz')",
        "(e.kind IN ('a') OR 'b' = e.kind)",
        "e.kind = 'a' OR e.kind IS NULL",
        "e.kind = 'a' OR e.qty = 3",
    ],
    "e.tag": [
        "e.tag LIKE 'al%'",
        "e.tag LIKE 'a_pha'",
        "e.tag LIKE 'al\\_ha'",
        "e.tag LIKE '%\\%'",
        "e.tag LIKE '%\\\\%'",
        "e.tag LIKE '_'",
        "e.tag LIKE '%e%'",
        "e.tag LIKE '_mega'",
        "e.tag ILIKE 'ALPHA'",
        "e.tag ILIKE 'é'",
        "e.tag ILIKE 'STRASSE'",
        "e.tag ILIKE '%MEGA'",
        "e.tag NOT LIKE 'a%'",
        "e.tag NOT ILIKE '%a%'",
        "e.tag LIKE 'al%' ESCAPE '\\'",
        "e.tag LIKE 'al#_ha' ESCAPE '#'",
        "lower(e.tag) LIKE 'al%'",
        "e.tag NOT IN ('alpha', 'é')",
        "e.tag NOT IN ('zeta')",
        "e.tag = 'alpha' OR e.tag = 'É'",
        "e.tag IN ('al_ha', '50%') OR e.tag = 'zeta'",
        "e.tag = 'straße' OR e.tag IN ('e\u0301', 'Ωmega')",
        "e.tag LIKE 'al%' OR e.tag = 'é'",
    ],
    "e.qty": [
        "e.qty NOT IN (1, 2, 3)",
        "e.qty = 1 OR e.qty IN (3, 5)",
        "e.qty IN (2, 2.5) OR e.qty = 100",
        "e.qty NOT IN (0, NULL)",
    ],
    "e.day": [
        "e.day NOT IN (DATE '2024-02-10', DATE '2024-02-11')",
        "e.day = DATE '2024-02-10' OR e.day = DATE '2024-02-12'",
        "e.day IN (TIMESTAMP '2024-02-10 00:00:00', TIMESTAMP '2024-02-11 12:00:00')",
    ],
    "e.flag": ["e.flag NOT IN (TRUE)", "e.flag = TRUE OR e.flag = FALSE"],
}
PEOPLE_NARROWING_WHERE = {"p.grp": ["p.grp NOT IN ('a')", "p.grp LIKE '_'", "p.grp = 'b' OR p.grp IN ('c')"]}


LINE_KEYS = ["l.color", "FLOOR(l.price / 25)"]
LINE_MEASURES = [
    "COUNT(*)",
    "SUM(l.price)",
    "AVG(l.price)",
    "COUNT(l.price)",
    "COUNT(DISTINCT l.color)",
    "MAX(l.price)",
]
LINE_WHERE = ["l.price > 20", "l.color = 'red'", "l.color IS NULL", "l.eid IS NOT NULL"]


@st.composite
def line_queries(draw: st.DrawFn) -> str:
    """Over lines, two hops from the person (three with households): alone, or joined to its event (a
    foreign-key lookup: one event per line, or two where the event id repeats) and on to the person."""
    join = draw(st.sampled_from(["", "events", "people", "events-first"]))
    source = {
        "": "lines l",
        "events": "lines l JOIN events e ON l.eid = e.eid",
        "people": "lines l JOIN events e ON l.eid = e.eid JOIN people p ON e.pid = p.pid",
        "events-first": "events e LEFT JOIN lines l ON e.eid = l.eid",
    }[join]
    keys_pool = LINE_KEYS + (["e.kind", "e.flag"] if join else []) + (["p.grp"] if join == "people" else [])
    measures_pool = LINE_MEASURES + (["SUM(e.amount)", "COUNT(DISTINCT e.pid)"] if join else [])
    keys = draw(st.lists(st.sampled_from(keys_pool), max_size=2, unique=True))
    measures = draw(st.lists(st.sampled_from(measures_pool), min_size=1, max_size=3, unique=True))
    where_pool = LINE_WHERE + (["e.amount > 5", "e.kind IN ('a', 'b')"] if join else [])
    where = draw(st.sampled_from([None, None, *where_pool]))
    return _assemble(keys, measures, source, where)


#: The row-level ``visits`` table (each row its own person: no unit column, so no contribution bounding;
#: clamps and the one-row neighbour carry the proof), alone or joined to the public ``kinds``.
VISIT_KEYS = [
    "v.ward",
    "FLOOR(v.cost / 10)",
    "DATE_TRUNC('month', v.day)",
    "v.los > 5",
    "width_bucket(v.cost, 0, 50, 5)",
    "CASE WHEN v.los < 3 THEN 'short' ELSE 'long' END",
]
VISIT_MEASURES = [
    "COUNT(*)",
    "COUNT(v.cost)",
    "SUM(v.cost)",
    "AVG(v.cost)",
    "SUM(v.los)",
    "AVG(v.los)",
    "VAR_POP(v.cost)",
    "STDDEV(v.los)",
    "COUNT(DISTINCT v.ward)",
    "MIN(v.cost)",
    "MAX(v.los)",
    "percentile_cont(0.5) WITHIN GROUP (ORDER BY v.cost)",
    "COUNT(*) FILTER (WHERE v.los > 3)",
    "SUM(v.cost / 10.0)",
    "AVG(CASE WHEN v.ward = 'a' THEN v.cost END)",
]
VISIT_WHERE = [
    "v.cost > 10",
    "v.ward IN ('a', 'b')",
    "v.los BETWEEN 2 AND 8",
    "v.cost + 1 > 20",
    "v.ward NOT IN ('a')",
    "v.ward LIKE 'a%'",
    "v.day >= DATE '2024-03-01'",
    "v.cost IS NULL",
    "v.ward IN (SELECT name FROM kinds WHERE cat = 'x')",
]


@st.composite
def visit_queries(draw: st.DrawFn) -> str:
    """Over the row-level ``visits`` table: one row per person, every neighbour one more row."""
    join_kinds = draw(st.integers(0, 3)) == 0
    keys = draw(st.lists(st.sampled_from(VISIT_KEYS + (KIND_KEYS if join_kinds else [])), max_size=2, unique=True))
    distinct = bool(keys) and draw(st.integers(0, 5)) == 0
    measures = [] if distinct else draw(st.lists(st.sampled_from(VISIT_MEASURES), min_size=1, max_size=3, unique=True))
    where = draw(st.sampled_from([None, None, *VISIT_WHERE]))
    source = "visits v" + (" JOIN kinds k ON v.ward = k.name" if join_kinds else "")
    return _assemble(keys, measures, source, where, distinct=distinct)


#: Per-person values: a subquery grouped by the unit (one row per person), then aggregated outside.
PERSON_INNER = {
    "events": ("events e", "e.pid", ["COUNT(*)", "SUM(e.amount)", "AVG(e.qty)", "MAX(e.amount)", "MIN(e.day)"]),
    "lines": (
        "lines l JOIN events e ON l.eid = e.eid",
        "e.pid",
        ["COUNT(*)", "SUM(l.price)", "MAX(l.price)", "COUNT(DISTINCT l.color)"],
    ),
}
PERSON_HAVING = [None, "COUNT(*) > 2", "SUM(e.amount) >= 30 OR COUNT(*) = 1", "NOT (COUNT(*) < 2)"]


@st.composite
def person_queries(draw: st.DrawFn) -> str:
    """``SELECT … FROM (SELECT <unit>, <per-person aggregates> … GROUP BY <unit> [HAVING]) q``."""
    name = draw(st.sampled_from(sorted(PERSON_INNER)))
    source, unit, pool = PERSON_INNER[name]
    inner = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
    having = draw(st.sampled_from(PERSON_HAVING if name == "events" else PERSON_HAVING[:2]))
    where = draw(st.sampled_from([None, "e.amount > 10", "e.kind = 'a'"]))
    body = f"SELECT {unit}, " + ", ".join(f"{m} AS x{i}" for i, m in enumerate(inner)) + f" FROM {source}"
    body += (f" WHERE {where}" if where else "") + f" GROUP BY {unit}" + (f" HAVING {having}" if having else "")
    numeric = [f"q.x{i}" for i, m in enumerate(inner) if not m.startswith("MIN(e.day")]
    outer_pool = ["COUNT(*)", *(f"SUM({c})" for c in numeric), *(f"AVG({c})" for c in numeric)]
    measures = draw(st.lists(st.sampled_from(outer_pool), min_size=1, max_size=3, unique=True))
    keys = draw(st.lists(st.sampled_from([f"FLOOR({numeric[0]} / 2)"] if numeric else ["q.x0"]), max_size=1))
    return _assemble(keys, measures, f"({body}) q", None)


@st.composite
def queries(draw: st.DrawFn) -> str:
    """A random query from the accepted grammar (some draws are refused by the analyzer: skipped)."""
    family = draw(st.integers(0, 10))
    if family == 1:
        return draw(line_queries())
    if family == 2:
        return draw(person_queries())
    if family == 3:
        return draw(visit_queries())
    if family == 0:  # the unit table alone (max_rows 1)
        keys = draw(st.lists(st.sampled_from(PEOPLE_ONLY_KEYS), max_size=2, unique=True))
        measures = draw(st.lists(st.sampled_from(PEOPLE_ONLY_MEASURES), min_size=1, max_size=3, unique=True))
        where = draw(
            st.sampled_from(
                [
                    None,
                    "age < 60",
                    "grp = 'a'",
                    "age / 3 + score > 10",
                    *(w.replace("p.", "") for w in PEOPLE_NARROWING_WHERE["p.grp"]),
                ]
            )
        )
        return _assemble(keys, measures, "people", where)
    join_people = draw(st.booleans())
    join_kinds = draw(st.integers(0, 3)) == 0
    key_pool = EVENT_KEYS + (PEOPLE_KEYS if join_people else []) + (KIND_KEYS if join_kinds else [])
    families = {**EVENT_MEASURE_FAMILIES, **({"people": PEOPLE_MEASURES} if join_people else {})}
    measure = st.sampled_from(sorted(families)).flatmap(lambda family: st.sampled_from(families[family]))
    narrowing = NARROWING_WHERE | (PEOPLE_NARROWING_WHERE if join_people else {})
    shapes = [w for pool in narrowing.values() for w in pool]
    where_pool = EVENT_WHERE + (PEOPLE_WHERE if join_people else []) + shapes
    size = draw(st.sampled_from([0, 1, 1, 2, 2]))  # grouped queries are where the bounding paths differ
    keys = draw(st.lists(st.sampled_from(key_pool), min_size=size, max_size=size, unique=True))
    conjuncts = [w for w in [draw(st.sampled_from([None, None, *where_pool]))] if w]
    if draw(st.integers(0, 2)) == 0:  # narrow a grouped column: the domain released is the narrowed one
        column = draw(st.sampled_from(sorted(narrowing)))
        conjuncts = [draw(st.sampled_from(narrowing[column])), *conjuncts]
        if column not in keys:
            keys = [column, *keys[:1]]
    if draw(st.integers(0, 3)) == 0:  # and a second shape: narrowings intersect
        conjuncts.append(draw(st.sampled_from(where_pool)))
    distinct = bool(keys) and draw(st.integers(0, 5)) == 0
    measures = [] if distinct else draw(st.lists(measure, min_size=1, max_size=3, unique=True))
    source = "events e"
    comma = not join_kinds and draw(st.integers(0, 3)) == 0  # TPC-H's spelling: FROM a, b WHERE a.k = b.k
    if join_people and comma:
        source += ", people p"
        conjuncts.append("e.pid = p.pid")
    elif join_people:
        source += " JOIN people p ON e.pid = p.pid"
    if join_kinds:
        source += " JOIN kinds k ON e.kind = k.name"
    where = " AND ".join(f"({w})" for w in conjuncts) if len(conjuncts) > 1 else next(iter(conjuncts), None)
    return _assemble(keys, measures, source, where, distinct=distinct)


def _assemble(keys: list[str], measures: list[str], source: str, where: str | None, *, distinct: bool = False) -> str:
    if distinct:
        return f"SELECT DISTINCT {', '.join(keys)} FROM {source}" + (f" WHERE {where}" if where else "")
    items = [f"{k} AS k{i}" for i, k in enumerate(keys)] + [f"{m} AS v{i}" for i, m in enumerate(measures)]
    sql = f"SELECT {', '.join(items)} FROM {source}"
    if where:
        sql += f" WHERE {where}"
    if keys:
        sql += " GROUP BY " + ", ".join(f"k{i}" for i in range(len(keys)))
    return sql
