"""Tests that need what only root can install (SLURM, Chromium, network namespaces with tc) are marked
`@pytest.mark.needs(reason)`, where reason says what this machine lacks and how to install it, or is None when
nothing is missing. Such a test is skipped with its reason, except under CI (the CI variable set, as `.ci/run`
does), which installs all of it: there a missing tool fails the test instead of hiding it."""

import os

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(reason): what the test lacks here and how to install it, or None; "
                                       "skipped for that reason, failed under CI")


def missing(item) -> str | None:
    """What the test's `needs` markers say this machine lacks, if anything."""
    for mark in item.iter_markers("needs"):
        reason = mark.args[0] if mark.args else mark.kwargs.get("reason")
        if reason:
            return reason
    return None


def pytest_collection_modifyitems(config, items):
    if not under_ci():
        for item in items:
            if reason := missing(item):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start anything
def pytest_runtest_setup(item):
    if under_ci() and (reason := missing(item)):
        pytest.fail(f"under CI this test must run: {reason} (.ci/run installs what it needs)", pytrace=False)
