"""`python -m brain.sim ...`: the `alnair sim` command, standalone."""

from brain.sim.cli import main

raise SystemExit(main())
