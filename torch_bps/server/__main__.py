import sys

from torch_bps.server.cli import main

sys.exit(main())
