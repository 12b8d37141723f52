"""``python -m batchtap ...``: the ``batchtap`` command (``python -m batchtap run train.py``)."""

import sys

from batchtap.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
