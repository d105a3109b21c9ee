"""``python -m reference_impl.planner.v4``: DeepSeek-V4's capacity planner under its documented command. The
code lives with its family: :mod:`reference_impl.families.deepseek_v4.planner`."""

import sys

from reference_impl.families.deepseek_v4.planner import main

if __name__ == "__main__":
    sys.exit(main())
