"""tests/faults/ imports the shared helpers of tests/ (netns.py, dist_utils.py) like the tests there do."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
