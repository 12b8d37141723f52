"""The TensorFlow hooks read no softmax or sigmoid output that plain Keras leaves unread.

Keras computes the loss of a ``softmax`` (``sigmoid``) output layer from its logits, so plain
``fit()``'s graph never reads the activation and TensorFlow prunes it. Reading it (its values for accuracy, or only its
``tf.shape`` for a row's batch size, which does not fold while the batch dimension is unknown, as
in ``fit()``) keeps the op alive: ~0.14 ms a step on a tiny MLP (``bench/keras_fit.py --calls``).
The hooks read the logits instead. Checked on the traced graph of ``train_step`` with an unknown
batch dimension, in a subprocess (Keras picks its backend once per process).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.keras,
    pytest.mark.skipif(
        importlib.util.find_spec("keras") is None or importlib.util.find_spec("tensorflow") is None,
        reason="needs batchtap[keras] (keras, tensorflow-cpu)",
    ),
]

SCRIPT = r"""
import json, sys
import keras, tensorflow as tf
import batchtap as bt
from batchtap.integrations._keras_tf import TFRecorder

def softmax_readers(hooked, activation):
    units, loss = (5, "sparse_categorical_crossentropy") if activation == "softmax" else (1, "binary_crossentropy")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(units, activation=activation)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    model.optimizer.build(model.trainable_variables)
    tap = bt.Tap(sinks=[])
    if hooked:
        TFRecorder(model, tap, flush_every=None, freeze_on_nan=True)
    target = tf.TensorSpec([None], tf.int64) if activation == "softmax" else tf.TensorSpec([None, 1], tf.float32)
    signature = (tf.TensorSpec([None, 8], tf.float32), target)
    step = tf.function(lambda x, y: model.train_step((x, y)), input_signature=signature)
    graph = step.get_concrete_function().graph
    softmaxes = [op for op in graph.get_operations() if op.type == activation.capitalize()]
    readers = sorted(c.type for op in softmaxes for c in op.outputs[0].consumers())
    tap.close()
    return len(softmaxes), readers

activation = sys.argv[1]
print(json.dumps({"plain": softmax_readers(False, activation), "hooked": softmax_readers(True, activation)}))
"""


@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
def test_the_hooks_leave_the_output_activation_unread(activation: str) -> None:
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-c", SCRIPT, activation]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, hooked = found["plain"], found["hooked"]
    assert plain[0] == 1, found  # the model's activation is traced, and plain Keras reads it as below
    assert hooked[1] == plain[1], found
