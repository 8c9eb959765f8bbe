import sys

from torchtitan_megamoe.bench.cli import main

sys.exit(main())
