"""Fixtures for the adversarial suite: the health and clinic demos on DuckDB, fresh ledgers per test."""

from __future__ import annotations

from tests.demos import demo_engine_fixture, demo_fixture

adv_health_backend = demo_fixture("health")
adv_clinic_backend = demo_fixture("clinic")
#: The health engine (alice: ε budget 10, bob: 5, dataset: 50) with an empty in-memory ledger.
health = demo_engine_fixture("health", "adv_health_backend")
clinic = demo_engine_fixture("clinic", "adv_clinic_backend")
