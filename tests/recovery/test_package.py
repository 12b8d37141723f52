"""batchtap.recovery is the home of the training-side tools; their old names under bt.rules still work."""

from __future__ import annotations

import batchtap as bt
import batchtap.recovery
import batchtap.rules


def test_public_names_are_exported():
    for name in batchtap.recovery.__all__:
        assert hasattr(batchtap.recovery, name), name
    assert len(set(batchtap.recovery.__all__)) == len(batchtap.recovery.__all__)


def test_every_recovery_name_is_the_same_object_under_its_old_rules_name():
    for name in batchtap.recovery.__all__:
        assert name in batchtap.rules.__all__ and name in dir(batchtap.rules), name
        assert getattr(batchtap.rules, name) is getattr(batchtap.recovery, name), name


def test_top_level_names_come_from_recovery():
    for name in ("Rollback", "AdaptiveBatchSampler", "BatchSizeRule", "split_on_oom", "debug_mode"):
        assert getattr(bt, name) is getattr(batchtap.recovery, name), name
