"""TLS (SSLRequest → 'S' → handshake) and, when a JDK and the JDBC driver exist, pgjdbc."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from .conftest import Running, open_engine, self_signed_cert, serving

JDBC_JAR = Path("/usr/share/java/postgresql.jar")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    made = self_signed_cert(tmp_path_factory.mktemp("tls"))
    if made is None:
        pytest.skip("openssl not installed")
    cert, key = made
    with serving(open_engine(trust=True), tls_cert=str(cert), tls_key=str(key), catalog_dsn="") as (running, _):
        yield running


def test_tls_required(tls_server: Running) -> None:
    with psycopg.connect(tls_server.dsn(sslmode="require"), autocommit=True) as conn:
        assert conn.pgconn.ssl_in_use
        assert isinstance(conn.execute("SELECT COUNT(*) FROM patients").fetchone()[0], int)  # type: ignore[index]


JAVA = """
import java.sql.*;
public class Probe {
  public static void main(String[] a) throws Exception {
    try (Connection c = DriverManager.getConnection(a[0], "analyst", "")) {
      DatabaseMetaData md = c.getMetaData();
      try (ResultSet t = md.getTables(null, "public", "%", new String[]{"TABLE"})) {
        while (t.next()) System.out.println("table " + t.getString("TABLE_NAME"));
      }
      try (PreparedStatement ps = c.prepareStatement("SELECT COUNT(*) AS n FROM patients WHERE age > ?")) {
        ps.setInt(1, 30);
        try (ResultSet r = ps.executeQuery()) { r.next(); System.out.println("count " + r.getLong("n")); }
      }
    }
  }
}
"""


@pytest.mark.skipif(not (shutil.which("javac") and JDBC_JAR.exists()), reason="JDK or pgjdbc missing")
def test_jdbc(dp_server: Running, tmp_path: Path) -> None:
    (tmp_path / "Probe.java").write_text(JAVA)
    subprocess.run(["javac", "Probe.java"], cwd=tmp_path, check=True, capture_output=True, timeout=120)
    url = f"jdbc:postgresql://{dp_server.host}:{dp_server.port}/health"
    out = subprocess.run(
        ["java", "-cp", f"{tmp_path}:{JDBC_JAR}", "Probe", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "table patients" in out.stdout and "count " in out.stdout
