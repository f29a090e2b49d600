import sys

from torch_bps.timeline.merge import main

sys.exit(main())
