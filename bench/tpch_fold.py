"""TPC-H as written, for #36 items 3, 4, 6, 7: folded constants, row arithmetic, public tables, empty answers.

DuckDB's own ``dbgen`` needs its tpch extension, which is downloaded (no network here), so this
generates TPC-H-shaped data in SQL (:func:`generate`: the eight tables, dbgen's row counts per scale
factor, its value ranges and date logic; deterministic, from ``hash``), in memory, nothing written to
the repository. Two policies: ``customer`` (the customer is the person; orders reference it; part,
supplier, partsupp, nation and region are public; lineitem is left out, its unit two hops away) and
``order`` (each order a unit, lineitem referencing it: one hop, for the lineitem queries until
multi-hop units land). Each query runs as written on raw DuckDB and through dpsql's engine (no result
cache, a fresh in-memory ledger, ε=1); printed: answered or the refusal, rows, ε charged, and the median
time ratio dpsql / raw over ``--repeat`` runs.

    .venv/bin/python bench/tpch_fold.py --sf 0.01
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import sqlglot

from dpsql.analyze.fold import fold_constants
from dpsql.backends import Backend, open_backend
from dpsql.engine import Engine
from dpsql.errors import Error
from dpsql.ledger import Ledger
from dpsql.policy import parse_policy
from dpsql.session import Session

_WORDS = (
    "'almond','antique','aquamarine','azure','beige','bisque','black','blanched','blue','blush','brown','burlywood'"
)
TABLES = f"""
CREATE TABLE region AS SELECT i AS r_regionkey, ['AFRICA','AMERICA','ASIA','EUROPE','MIDDLE EAST'][i + 1] AS r_name,
  'region ' || i AS r_comment FROM range(5) t(i);
CREATE TABLE nation AS SELECT i AS n_nationkey, ['ALGERIA','ARGENTINA','BRAZIL','CANADA','EGYPT','ETHIOPIA','FRANCE',
  'GERMANY','INDIA','INDONESIA','IRAN','IRAQ','JAPAN','JORDAN','KENYA','MOROCCO','MOZAMBIQUE','PERU','CHINA','ROMANIA',
  'SAUDI ARABIA','VIETNAM','RUSSIA','UNITED KINGDOM','UNITED STATES'][i + 1] AS n_name,
  [0,1,1,1,4,0,3,3,2,2,4,4,2,4,0,0,0,1,2,3,4,2,3,3,1][i + 1] AS n_regionkey, 'nation ' || i AS n_comment
  FROM range(25) t(i);
CREATE TABLE supplier AS SELECT i AS s_suppkey, 'Supplier#' || lpad(i::VARCHAR, 9, '0') AS s_name,
  'addr' || hash(i, 1) % 1000 AS s_address, (hash(i, 2) % 25)::INTEGER AS s_nationkey,
  '1' || (hash(i, 3) % 900 + 100) || '-555-0100' AS s_phone,
  round((hash(i, 4) % 1099998) / 100.0 - 999.99, 2) AS s_acctbal,
  CASE WHEN hash(i, 5) % 200 = 0 THEN 'wary Customer slyly Complaints' ELSE 'carefully final deposits' END AS s_comment
  FROM range(1, $supp + 1) t(i);
CREATE TABLE part AS SELECT i AS p_partkey,
  [{_WORDS}][hash(i, 6) % 12 + 1] || ' ' || [{_WORDS}][hash(i, 7) % 12 + 1] AS p_name,
  'Manufacturer#' || (hash(i, 8) % 5 + 1) AS p_mfgr,
  'Brand#' || (hash(i, 8) % 5 + 1) || (hash(i, 9) % 5 + 1) AS p_brand,
  ['STANDARD','SMALL','MEDIUM','LARGE','ECONOMY','PROMO'][hash(i, 10) % 6 + 1] || ' ' ||
  ['ANODIZED','BURNISHED','PLATED','POLISHED','BRUSHED'][hash(i, 11) % 5 + 1] || ' ' ||
  ['TIN','NICKEL','BRASS','STEEL','COPPER'][hash(i, 12) % 5 + 1] AS p_type,
  (hash(i, 13) % 50 + 1)::INTEGER AS p_size, ['SM','LG','MED','JUMBO','WRAP'][hash(i, 14) % 5 + 1] || ' ' ||
  ['CASE','BOX','BAG','JAR','PKG','PACK','CAN','DRUM'][hash(i, 15) % 8 + 1] AS p_container,
  round(900 + (i % 20001) / 10.0 + 100 * (i % 1000) / 1000.0, 2) AS p_retailprice, 'part ' || i AS p_comment
  FROM range(1, $part + 1) t(i);
CREATE TABLE partsupp AS SELECT p AS ps_partkey, ((p + j * ($supp // 4 + (p - 1) // $supp)) % $supp) + 1 AS ps_suppkey,
  (hash(p, j, 16) % 9999 + 1)::INTEGER AS ps_availqty, round((hash(p, j, 17) % 99901) / 100.0 + 1, 2) AS ps_supplycost,
  'partsupp ' || p AS ps_comment FROM range(1, $part + 1) t(p), range(4) s(j);
CREATE TABLE customer AS SELECT i AS c_custkey, 'Customer#' || lpad(i::VARCHAR, 9, '0') AS c_name,
  'addr' || hash(i, 18) % 1000 AS c_address, (hash(i, 19) % 25)::INTEGER AS c_nationkey,
  (hash(i, 19) % 25 + 10) || '-555-0100' AS c_phone, round((hash(i, 20) % 1099998) / 100.0 - 999.99, 2) AS c_acctbal,
  ['AUTOMOBILE','BUILDING','FURNITURE','MACHINERY','HOUSEHOLD'][hash(i, 21) % 5 + 1] AS c_mktsegment,
  'customer ' || i AS c_comment FROM range(1, $cust + 1) t(i);
CREATE TABLE orders AS SELECT i * 4 - 3 AS o_orderkey,
  ((hash(i, 22) % ($cust * 2 // 3)) // 2 * 3 + 1 + hash(i, 23) % 2)::BIGINT AS o_custkey,
  ['F','O','P'][hash(i, 24) % 3 + 1] AS o_orderstatus,
  round(1000 + (hash(i, 25) % 45000000) / 100.0, 2) AS o_totalprice,
  DATE '1992-01-01' + (hash(i, 26) % 2405)::INTEGER AS o_orderdate,
  ['1-URGENT','2-HIGH','3-MEDIUM','4-NOT SPECIFIED','5-LOW'][hash(i, 27) % 5 + 1] AS o_orderpriority,
  'Clerk#' || lpad((hash(i, 28) % 1000)::VARCHAR, 9, '0') AS o_clerk, 0 AS o_shippriority,
  CASE WHEN hash(i, 29) % 100 = 0 THEN 'special requests' ELSE 'regular deposits' END AS o_comment
  FROM range(1, $orders + 1) t(i);
CREATE TABLE lineitem AS SELECT o_orderkey AS l_orderkey, (hash(o_orderkey, n, 30) % $part + 1)::BIGINT AS l_partkey,
  (hash(o_orderkey, n, 31) % $supp + 1)::BIGINT AS l_suppkey, n AS l_linenumber,
  (hash(o_orderkey, n, 32) % 50 + 1)::DECIMAL(15, 2) AS l_quantity,
  round((hash(o_orderkey, n, 32) % 50 + 1) * (900 + hash(o_orderkey, n, 30) % 1100), 2)::DECIMAL(15, 2)
    AS l_extendedprice,
  ((hash(o_orderkey, n, 33) % 11) / 100.0)::DECIMAL(15, 2) AS l_discount,
  ((hash(o_orderkey, n, 34) % 9) / 100.0)::DECIMAL(15, 2) AS l_tax,
  CASE WHEN o_orderdate + 60 <= DATE '1995-06-17' THEN ['R','A'][hash(o_orderkey, n, 35) % 2 + 1] ELSE 'N' END
    AS l_returnflag,
  CASE WHEN o_orderdate + 60 > DATE '1995-06-17' THEN 'O' ELSE 'F' END AS l_linestatus,
  o_orderdate + (hash(o_orderkey, n, 36) % 121 + 1)::INTEGER AS l_shipdate,
  o_orderdate + (hash(o_orderkey, n, 37) % 61 + 30)::INTEGER AS l_commitdate,
  o_orderdate + (hash(o_orderkey, n, 36) % 121 + 2 + hash(o_orderkey, n, 38) % 30)::INTEGER AS l_receiptdate,
  ['DELIVER IN PERSON','COLLECT COD','NONE','TAKE BACK RETURN'][hash(o_orderkey, n, 39) % 4 + 1] AS l_shipinstruct,
  ['REG AIR','AIR','RAIL','SHIP','TRUCK','MAIL','FOB'][hash(o_orderkey, n, 40) % 7 + 1] AS l_shipmode,
  'lineitem' AS l_comment FROM orders, range(1, 8) t(n) WHERE n <= hash(o_orderkey, 41) % 7 + 1;
"""


def generate(backend: Backend, sf: float) -> None:
    """The eight TPC-H tables at scale factor ``sf`` (dbgen's counts: 10,000 suppliers, 200,000 parts,
    150,000 customers and 1,500,000 orders per unit of scale; 1 to 7 lines per order)."""
    sizes = {"supp": 10_000, "part": 200_000, "cust": 150_000, "orders": 1_500_000}
    script = TABLES
    for name, per_unit in sizes.items():
        script = script.replace(f"${name}", str(max(5, int(per_unit * sf))))
    script = re.sub(r"hash\(([^()]*)\)", r"(hash(\1) % 1000000007)::BIGINT", script)  # UBIGINT: no index
    backend.execute_script(script)


_PUBLIC = """
  part: {public: true, columns: {p_partkey: {type: int}, p_name: {type: text}, p_mfgr: {type: text},
    p_brand: {type: text}, p_type: {type: text}, p_size: {type: int, lower: 1, upper: 50}, p_container: {type: text},
    p_retailprice: {type: float, lower: 900, upper: 2100}, p_comment: {type: text}}}
  supplier: {public: true, columns: {s_suppkey: {type: int}, s_name: {type: text}, s_address: {type: text},
    s_nationkey: {type: int}, s_phone: {type: text}, s_acctbal: {type: float, lower: -1000, upper: 10000},
    s_comment: {type: text}}}
  partsupp: {public: true, columns: {ps_partkey: {type: int}, ps_suppkey: {type: int},
    ps_availqty: {type: int, lower: 1, upper: 9999}, ps_supplycost: {type: float, lower: 1, upper: 1000},
    ps_comment: {type: text}}}
  nation: {public: true, columns: {n_nationkey: {type: int}, n_name: {type: text}, n_regionkey: {type: int},
    n_comment: {type: text}}}
  region: {public: true, columns: {r_regionkey: {type: int}, r_name: {type: text}, r_comment: {type: text}}}
"""
_HEAD = """dataset: tpch
defaults: {epsilon: 1.0, delta: 1.0e-6, mechanism: laplace, confidence: 0.95}
budget: {dataset: {epsilon: 1.0e6, delta: 0.5}, analyst: {epsilon: 1.0e6, delta: 0.5}}
auth: {trust: true}
analysts: [{name: analyst}]
tables:
"""
_ORDERS = """
    columns: {o_orderkey: {type: int, identifier: true}, o_custkey: {type: int, identifier: true},
      o_orderstatus: {type: text, domain: [F, O, P]}, o_totalprice: {type: float, lower: 800, upper: 600000},
      o_orderdate: {type: date, lower: 1992-01-01, upper: 1998-12-31},
      o_orderpriority: {type: text, domain: [1-URGENT, 2-HIGH, 3-MEDIUM, 4-NOT SPECIFIED, 5-LOW]},
      o_clerk: {type: text}, o_shippriority: {type: int, lower: 0, upper: 0}, o_comment: {type: text}}
"""
#: The customer is the person; lineitem (two hops away) is left out of this policy.
CUSTOMER_POLICY = (
    _HEAD
    + """  customer:
    privacy_unit: c_custkey
    columns: {c_custkey: {type: int, identifier: true}, c_name: {type: text, identifier: true},
      c_address: {type: text, identifier: true}, c_nationkey: {type: int, lower: 0, upper: 24},
      c_phone: {type: text, identifier: true}, c_acctbal: {type: float, lower: -1000, upper: 10000},
      c_mktsegment: {type: text, domain: [AUTOMOBILE, BUILDING, FURNITURE, MACHINERY, HOUSEHOLD]},
      c_comment: {type: text}}
  orders:
    references: {column: o_custkey, table: customer, to: c_custkey}
    max_rows_per_unit: 20
"""
    + _ORDERS
    + _PUBLIC
)
#: Each order is a unit and lineitem references it (one hop): the lineitem queries' stand-in.
ORDER_POLICY = (
    _HEAD
    + """  orders:
    privacy_unit: o_orderkey
"""
    + _ORDERS
    + """  lineitem:
    references: {column: l_orderkey, table: orders, to: o_orderkey}
    max_rows_per_unit: 7
    columns: {l_orderkey: {type: int, identifier: true}, l_partkey: {type: int}, l_suppkey: {type: int},
      l_linenumber: {type: int, lower: 1, upper: 7}, l_quantity: {type: float, lower: 1, upper: 50},
      l_extendedprice: {type: float, lower: 900, upper: 105000}, l_discount: {type: float, lower: 0, upper: 0.1},
      l_tax: {type: float, lower: 0, upper: 0.08}, l_returnflag: {type: text, domain: [A, N, R], nullable: false},
      l_linestatus: {type: text, domain: [F, O], nullable: false},
      l_shipdate: {type: date, lower: 1992-01-01, upper: 1998-12-31},
      l_commitdate: {type: date, lower: 1992-01-01, upper: 1998-12-31},
      l_receiptdate: {type: date, lower: 1992-01-01, upper: 1998-12-31}, l_shipinstruct: {type: text},
      l_shipmode: {type: text, domain: [REG AIR, AIR, RAIL, SHIP, TRUCK, MAIL, FOB]}, l_comment: {type: text}}
"""
    + _PUBLIC
)

#: (name, policy, SQL as written): TPC-H text with its validation parameters, and analyst habits.
QUERIES: list[tuple[str, str, str]] = [
    ("Q1", "order", "select l_returnflag, l_linestatus, sum(l_quantity) as sum_qty, sum(l_extendedprice) as "
     "sum_base_price, sum(l_extendedprice * (1 - l_discount)) as sum_disc_price, sum(l_extendedprice * (1 - "
     "l_discount) * (1 + l_tax)) as sum_charge, avg(l_quantity) as avg_qty, avg(l_extendedprice) as avg_price, "
     "avg(l_discount) as avg_disc, count(*) as count_order from lineitem where l_shipdate <= date '1998-12-01' - "
     "interval '90' day (3) group by l_returnflag, l_linestatus order by l_returnflag, l_linestatus"),
    ("Q6", "order", "select sum(l_extendedprice * l_discount) as revenue from lineitem where l_shipdate >= date "
     "'1994-01-01' and l_shipdate < date '1994-01-01' + interval '1' year and l_discount between 0.06 - 0.01 and "
     "0.06 + 0.01 and l_quantity < 24"),
    ("Q2", "customer", "select s_acctbal, s_name, n_name, p_partkey, p_mfgr, s_address, s_phone, s_comment from "
     "part, supplier, partsupp, nation, region where p_partkey = ps_partkey and s_suppkey = ps_suppkey and p_size = "
     "15 and p_type like '%BRASS' and s_nationkey = n_nationkey and n_regionkey = r_regionkey and r_name = 'EUROPE' "
     "and ps_supplycost = (select min(ps_supplycost) from partsupp, supplier, nation, region where p_partkey = "
     "ps_partkey and s_suppkey = ps_suppkey and s_nationkey = n_nationkey and n_regionkey = r_regionkey and r_name "
     "= 'EUROPE') order by s_acctbal desc, n_name, s_name, p_partkey limit 100"),
    ("Q11", "customer", "select ps_partkey, sum(ps_supplycost * ps_availqty) as value from partsupp, supplier, "
     "nation where ps_suppkey = s_suppkey and s_nationkey = n_nationkey and n_name = 'GERMANY' group by ps_partkey "
     "having sum(ps_supplycost * ps_availqty) > (select sum(ps_supplycost * ps_availqty) * 0.0001000000 from "
     "partsupp, supplier, nation where ps_suppkey = s_suppkey and s_nationkey = n_nationkey and n_name = 'GERMANY') "
     "order by value desc"),
    ("Q16", "customer", "select p_brand, p_type, p_size, count(distinct ps_suppkey) as supplier_cnt from partsupp, "
     "part where p_partkey = ps_partkey and p_brand <> 'Brand#45' and p_type not like 'MEDIUM POLISHED%' and p_size "
     "in (49, 14, 23, 45, 19, 3, 36, 9) and ps_suppkey not in (select s_suppkey from supplier where s_comment like "
     "'%Customer%Complaints%') group by p_brand, p_type, p_size order by supplier_cnt desc, p_brand, p_type, p_size"),
    ("public count", "customer", "select count(*) from part where p_size = 15"),
    ("Q4 core", "customer", "select o_orderpriority, count(*) as order_count from orders where o_orderdate >= date "
     "'1993-07-01' and o_orderdate < date '1993-07-01' + interval '3' month group by o_orderpriority order by "
     "o_orderpriority"),
    ("where arithmetic", "customer", "select count(*) from orders where o_totalprice * (1 - 0.05) > 100000"),
    ("division in sum", "customer", "select sum(o_totalprice / 1000.0), avg(c_acctbal::float) from orders join "
     "customer on o_custkey = c_custkey"),
    ("line arithmetic", "order", "select count(*) from lineitem where l_extendedprice * (1 - l_discount) > 1000"),
    ("cast in avg", "order", "select l_shipmode, avg(cast(l_quantity as double precision)), sum(l_quantity / 10) "
     "from lineitem group by l_shipmode"),
    ("empty selection", "customer", "select o_clerk, count(*) from orders where o_totalprice > 599000 "
     "group by o_clerk"),
]  # fmt: skip


def _median_seconds(run: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sf", type=float, default=0.01)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    backend = open_backend("duckdb://")
    started = time.perf_counter()
    generate(backend, args.sf)
    print(f"generated TPC-H SF{args.sf:g} in {time.perf_counter() - started:.1f} s")
    policies = {"customer": parse_policy(CUSTOMER_POLICY), "order": parse_policy(ORDER_POLICY)}
    session = Session("analyst", epsilon=1.0)
    ratios = []
    for name, which, sql in QUERIES:
        engine = Engine(policies[which], backend, Ledger.open("memory"))
        try:
            result = engine.execute(sql, session)
        except Error as exc:
            print(f"{name:18} refused {exc.sqlstate}: {exc.message}")
            continue
        # raw DuckDB runs the same text with PostgreSQL's constants (DuckDB reads neither DAY (3) nor 7 / 2 so)
        plain = fold_constants(sqlglot.parse_one(sql, read="postgres")).sql(dialect="duckdb")
        raw = _median_seconds(lambda plain=plain: backend.execute(plain), args.repeat)
        dp = _median_seconds(lambda e=engine, sql=sql: e.execute(sql, session), args.repeat)
        ratios.append(dp / raw)
        notes = [n for n in result.notices if "public tables only" in n or "no group was released" in n]
        print(
            f"{name:18} answered {len(result.rows)} rows, ε={result.epsilon_spent:g}, raw {raw * 1000:.1f} ms, "
            f"dpsql {dp * 1000:.1f} ms: {dp / raw:.1f}x" + (f"  [{notes[0][:90]}…]" if notes else "")
        )
    if ratios:
        print(f"median dpsql/raw over answered queries: {statistics.median(ratios):.1f}x")


if __name__ == "__main__":
    main()
