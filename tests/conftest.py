"""Shared pytest configuration; PostgreSQL fixtures live in tests/pg.py."""

pytest_plugins = ["tests.pg"]
