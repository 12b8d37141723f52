"""The loops here are scripts that ``batchtap audit`` runs (tests/cli/test_audit.py); importing one
would train it, so the suite's module and doctest collection skips them."""

collect_ignore_glob = ["*_planted.py"]
