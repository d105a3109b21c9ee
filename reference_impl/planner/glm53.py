"""``python -m reference_impl.planner.glm53``: GLM-5.3's capacity planner under its documented command. The
code lives with its family: :mod:`reference_impl.families.glm53.planner`."""

import sys

from reference_impl.families.glm53.planner import main

if __name__ == "__main__":
    sys.exit(main())
