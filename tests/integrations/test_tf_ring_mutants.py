"""``TFCapture``'s check of its ``extras`` names (``integrations/_tf_ring.py``): a slip a sampled
mutation run over issue 38's files drew there (TESTING.md, "third session"). TensorFlow is imported
in a child process only, as in the other Keras tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.keras,
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TFCapture needs TensorFlow"),
]

CHILD = textwrap.dedent(
    """
    import batchtap as bt
    from batchtap.errors import ConfigError
    from batchtap.integrations._tf_ring import TFCapture

    tap = bt.Tap([bt.metrics.Loss()], sinks=[])
    for name in ["loss", "lr", "accuracy", "", "loss/head", "accuracy/head", 3]:
        try:
            TFCapture(tap, extras=[name])
        except ConfigError as e:
            assert "extras must be new non-empty names" in str(e), e
        else:
            raise SystemExit(f"accepted {name!r}")
    TFCapture(tap, extras=["my_extra"])
    print("ok")
    """
)


def test_extras_named_like_a_built_in_column_empty_or_not_text_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=280,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES=""),
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr[-2000:]
