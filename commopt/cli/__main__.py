"""``python -m commopt.cli …`` is the ``commopt`` command (handy under torchrun)."""

import sys

from commopt.cli.main import main

__all__: list[str] = []

sys.exit(main())
