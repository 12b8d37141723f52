"""``import batchtap`` and a Tap's whole eager life load no ``torch._dynamo`` (seconds to import):
only a compiled caller needs it, and by then dynamo is loaded already. Checked in a fresh
interpreter, where nothing else loaded dynamo first."""

from __future__ import annotations

import subprocess
import sys

from tests.pipeline.test_distributed import ROOT


def test_a_taps_eager_life_does_not_import_dynamo() -> None:
    code = (
        "import sys\n"
        "import torch\n"
        "import batchtap as bt\n"
        "from tests.conftest import ListSink\n"
        "assert 'torch._dynamo' not in sys.modules, 'import batchtap loaded torch._dynamo'\n"
        "sink = ListSink()\n"
        "model = torch.nn.Linear(4, 3)\n"
        "tap = bt.Tap(sinks=[sink], flush_every=4)\n"
        "with tap.run(name='eager'):\n"
        "    for _ in range(10):\n"
        "        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))\n"
        "        out = model(x)\n"
        "        loss = torch.nn.functional.cross_entropy(out, y)\n"
        "        loss.backward()\n"
        "        tap.step(loss=loss, outputs=out, targets=y)\n"
        "tap.close()\n"
        "assert len(sink.records) == 10, len(sink.records)\n"
        "assert 'torch._dynamo' not in sys.modules, 'a Tap loaded torch._dynamo'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)
