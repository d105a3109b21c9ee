"""``python -m reference_impl.bench.glm53``: GLM-5.3's benchmark under its documented command. The code
lives with its family: :mod:`reference_impl.families.glm53.bench`."""

import sys

from reference_impl.families.glm53.bench import main

if __name__ == "__main__":
    sys.exit(main())
