"""`python -m services.computedomain controller|agent`."""

from services.computedomain.cli import main

raise SystemExit(main())
