"""`python -m services.discovery ...` until the `gpu-dra` dispatcher exists."""

import sys

from services.discovery.cli import main

sys.exit(main())
