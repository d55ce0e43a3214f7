"""`python -m stallfree` runs the command line."""

from stallfree.cli import main

raise SystemExit(main())
