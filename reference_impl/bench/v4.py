"""``python -m reference_impl.bench.v4``: DeepSeek-V4's benchmark under its documented command. The code
lives with its family: :mod:`reference_impl.families.deepseek_v4.bench`."""

import sys

from reference_impl.families.deepseek_v4.bench import main

if __name__ == "__main__":
    sys.exit(main())
