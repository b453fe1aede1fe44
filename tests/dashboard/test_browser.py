"""End to end in a real headless Chromium: charges made over the wire show on the curator's dashboard.

``dpsql serve`` on a file ledger (SQLite, then PostgreSQL); alice answers two queries with psycopg,
bob is refused once and sends a query whose column alias is a ``<script>``; ``dpsql dashboard`` on
the same ledger. Chromium is sent to the login page, a wrong password is refused (28P01), the right
one opens the analysts page with alice's ε spent; the audit trail lists the rows (the script as
text: nothing ran); a grant from the page raises bob's total on the running server and in
``dpsql budget``, a freeze from the page refuses his next query over the wire (42501). Screenshots
go to tests/dashboard/artifacts/.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.dashboard.conftest import PASSWORD, ROOT, Process
from tests.kinds import new_database_url

SCRIPT_ALIAS = "<script>document.title=7</script>"


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return new_database_url(request.param, request, tmp_path)


def _connect(port: int, user: str) -> psycopg.Connection[Any]:
    return psycopg.connect(f"postgresql://{user}@127.0.0.1:{port}/health", autocommit=True, connect_timeout=5)


def _budget_json(ledger: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "dpsql.cli", "budget", "--json", "--policy", "schemas/health.yaml", "--ledger", ledger],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return {row["analyst"]: row for row in json.loads(out.stdout)}


def _cell(driver: Any, row_id: str, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, f"#{row_id} {css}").text)


def _submit(driver: Any, element_id: str) -> None:
    """Click a submit button and wait for the next page to replace this one and finish loading.

    Chromium's driver sometimes resolves an element against a document it is still replacing
    ("Node with given id does not belong to the document") on a busy machine: the lookup and click are
    retried (the error comes from resolving the node, before any click is sent)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def loaded(d: Any) -> bool:
        return bool(d.execute_script("return document.readyState") == "complete")

    def click(d: Any) -> Any:
        page = d.find_element(By.TAG_NAME, "html")
        d.find_element(By.ID, element_id).click()
        return page

    def replaced(d: Any) -> bool:
        try:
            page.is_enabled()
        except WebDriverException:  # stale, or Chromium's "does not belong to the document": gone
            return True
        return False

    WebDriverWait(driver, 15).until(loaded)
    page = WebDriverWait(driver, 15, ignored_exceptions=(WebDriverException,)).until(click)
    WebDriverWait(driver, 15).until(replaced)
    WebDriverWait(driver, 15).until(loaded)


def _wait_audit(driver: Any, base: str, count: int) -> list[Any]:
    """Reload the audit page until the server's audit writer has caught up (it writes in batches)."""
    import time

    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + 20
    while True:
        driver.get(f"{base}/audit")
        rows = driver.find_elements(By.CSS_SELECTOR, "#audit tbody tr")
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.3)


def test_dashboard_in_chromium(
    chrome: Any,
    serve_and_dashboard: Callable[[str], tuple[Process, Callable[[], Process]]],
    ledger_url: str,
    artifacts: Path,
) -> None:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    serve, start_dashboard = serve_and_dashboard(ledger_url)
    with _connect(serve.port, "alice") as conn:
        conn.execute("SELECT COUNT(*) FROM patients WHERE age > 40").fetchall()
        conn.execute(f'SELECT COUNT(*) AS "{SCRIPT_ALIAS}" FROM patients').fetchall()
    with _connect(serve.port, "bob") as conn, pytest.raises(psycopg.Error) as refused:
        conn.execute("SELECT name FROM patients WHERE zip = 2138")
    assert refused.value.sqlstate == "42501"

    assert "curator dashboard: dpsql dashboard --policy" in serve.banner  # serve says where it is
    dashboard = start_dashboard()
    assert f"at http://127.0.0.1:{dashboard.port}/" in dashboard.banner
    base = dashboard.url
    driver = chrome
    driver.delete_all_cookies()

    # not logged in: every page sends the browser to the login page
    for page in ("/", "/audit", "/spend", "/policy"):
        driver.get(base + page)
        assert driver.current_url == f"{base}/login", page

    # a wrong password is refused, on the login page
    driver.find_element(By.ID, "password").send_keys("not the password")
    _submit(driver, "login")
    assert driver.current_url == f"{base}/login"
    refusal = "ERROR: 28P01: password authentication failed for the curator"
    WebDriverWait(driver, 15, ignored_exceptions=(WebDriverException,)).until(
        lambda d: d.find_element(By.ID, "error").text == refusal
    )
    driver.save_screenshot(str(artifacts / "login-refused.png"))

    driver.find_element(By.ID, "password").send_keys(PASSWORD)
    _submit(driver, "login")
    assert driver.current_url == f"{base}/"
    assert driver.find_element(By.TAG_NAME, "h1").text == "Analysts"
    assert _cell(driver, "analyst-alice", ".analyst") == "alice"
    assert float(_cell(driver, "analyst-alice", ".eps-spent")) == 2.0  # two answers at the policy's ε = 1
    assert float(_cell(driver, "analyst-alice", ".eps-remaining")) == 8.0
    assert float(_cell(driver, "analyst-bob", ".eps-spent")) == 0.0  # refused: free
    assert float(_cell(driver, "dataset", ".eps-spent")) == 2.0
    driver.save_screenshot(str(artifacts / "analysts.png"))

    rows = _wait_audit(driver, base, 3)
    assert len(rows) == 3
    texts = [r.text for r in rows]
    assert sum("alice" in t and "answered" in t for t in texts) == 2
    assert any("bob" in t and "refused" in t and "42501" in t for t in texts)
    shapes = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#audit .shape")]
    assert any(SCRIPT_ALIAS in s for s in shapes), shapes  # shown as text ...
    assert driver.title == "Audit trail · dpsql curator"  # ... and never run
    assert SCRIPT_ALIAS not in driver.page_source  # the markup holds it escaped only
    driver.save_screenshot(str(artifacts / "audit.png"))

    # the filters: bob's refusals only
    driver.find_element(By.ID, "filter-analyst").send_keys("bob")
    Select(driver.find_element(By.ID, "filter-outcome")).select_by_value("refused")
    _submit(driver, "filter-submit")
    rows = driver.find_elements(By.CSS_SELECTOR, "#audit tbody tr")
    assert len(rows) == 1 and "42501" in rows[0].text

    driver.get(f"{base}/spend")
    series = driver.find_elements(By.CSS_SELECTOR, "#spend-plot polyline.series")
    assert [s.get_attribute("data-analyst") for s in series] == ["alice"]
    driver.save_screenshot(str(artifacts / "spend.png"))

    driver.get(f"{base}/policy")
    assert "patients" in driver.find_element(By.TAG_NAME, "main").text
    driver.save_screenshot(str(artifacts / "policy.png"))

    # grant from the page: the ledger's row, seen by dpsql budget and by the running server
    before = _budget_json(ledger_url)["bob"]
    driver.get(f"{base}/")
    Select(driver.find_element(By.ID, "lever-analyst")).select_by_value("bob")
    Select(driver.find_element(By.ID, "lever-action")).select_by_value("grant")
    driver.find_element(By.ID, "lever-epsilon").clear()
    driver.find_element(By.ID, "lever-epsilon").send_keys("2")
    driver.find_element(By.ID, "lever-reason").send_keys("thesis chapter 3")
    _submit(driver, "lever-submit")
    assert "grant ε=2 δ=0" in driver.find_element(By.ID, "message").text
    assert float(_cell(driver, "analyst-bob", "td:nth-child(3)")) == before["epsilon_total"] + 2
    driver.save_screenshot(str(artifacts / "granted.png"))
    after = _budget_json(ledger_url)["bob"]
    assert after["epsilon_total"] == before["epsilon_total"] + 2
    with _connect(serve.port, "bob") as conn:
        shown = conn.execute("SHOW dpsql.budget").fetchone()
        names = [d.name for d in conn.execute("SHOW dpsql.budget").description or ()]
    assert shown is not None and dict(zip(names, shown, strict=True))["epsilon_total"] == after["epsilon_total"]

    # freeze from the page: bob's next statement is refused over the wire
    Select(driver.find_element(By.ID, "lever-analyst")).select_by_value("bob")
    Select(driver.find_element(By.ID, "lever-action")).select_by_value("freeze")
    driver.find_element(By.ID, "lever-reason").send_keys("probing")
    _submit(driver, "lever-submit")
    assert _cell(driver, "analyst-bob", ".frozen") == "frozen"
    with _connect(serve.port, "bob") as conn, pytest.raises(psycopg.Error) as frozen:
        conn.execute("SELECT COUNT(*) FROM patients")
    assert frozen.value.sqlstate == "42501"
    assert 'froze the privacy budget of analyst "bob"' in str(frozen.value)

    # the levers are in the audit trail, with who and why
    driver.get(f"{base}/audit?analyst=bob&outcome=grant")
    rows = driver.find_elements(By.CSS_SELECTOR, "#audit tbody tr")
    assert len(rows) == 1 and "thesis chapter 3" in rows[0].text and "curator-test (dashboard)" in rows[0].text

    # log out: the pages are closed again
    _submit(driver, "logout")
    WebDriverWait(driver, 10).until(lambda d: d.current_url == f"{base}/login")
    driver.get(f"{base}/")
    assert driver.current_url == f"{base}/login"
    assert PASSWORD not in "".join(dashboard.log)
