"""``python -m reference_impl``: see :mod:`reference_impl.cli`."""

import sys

from reference_impl.cli import main

sys.exit(main())
