"""``python -m torchtitan_megamoe.ab``; the command line itself is in ``cli``."""

from torchtitan_megamoe.ab.cli import main

raise SystemExit(main())
