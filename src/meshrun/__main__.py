import sys

from meshrun.cli import main

sys.exit(main())
