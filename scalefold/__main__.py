"""``python -m scalefold`` is the ``scalefold`` command."""

import sys

from scalefold.cli import main

sys.exit(main())
