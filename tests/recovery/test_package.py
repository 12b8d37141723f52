"""batchtap.recovery is the home of the training-side tools; their old names under bt.rules say where they went
(a re-export, even a lazy one, would make rules and recovery import each other)."""

from __future__ import annotations

import pytest

import batchtap as bt
import batchtap.recovery
import batchtap.rules


def test_public_names_are_exported():
    for name in batchtap.recovery.__all__:
        assert hasattr(batchtap.recovery, name), name
    assert len(set(batchtap.recovery.__all__)) == len(batchtap.recovery.__all__)


def test_every_recovery_name_under_its_old_rules_name_says_where_it_went():
    for name in batchtap.recovery.__all__:
        assert name not in batchtap.rules.__all__, name
        with pytest.raises(
            AttributeError, match=rf"batchtap\.rules\.{name} moved to batchtap\.recovery: use bt\.recovery\.{name}"
        ):
            getattr(batchtap.rules, name)
        assert getattr(bt.recovery, name) is getattr(batchtap.recovery, name), name


def test_top_level_names_come_from_recovery():
    for name in ("Rollback", "AdaptiveBatchSampler", "BatchSizeRule", "split_on_oom", "debug_mode"):
        assert getattr(bt, name) is getattr(batchtap.recovery, name), name
