"""Shared test set-up (offline, single-threaded torch, a per-session model cache, shared fixtures): defined in
``tests/_support/fixtures.py`` and loaded here for every test folder."""

pytest_plugins = ["_support.fixtures", "pytester"]
