"""Does clawd learn a user's preference from conversation? Hybrid vs binary RL vs OPD.

The harness lives in the package (clawd/bench/learning.py) so `clawd bench learning` works
from an installed clawd too; this script is the same thing from a checkout:

    python benchmarks/learning.py --users detailed --steps 8 --batch 4
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clawd.bench.learning import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
