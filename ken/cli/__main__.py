"""``python -m ken.cli``: the ``ken`` command."""

import sys

from ken.cli import main

sys.exit(main())
