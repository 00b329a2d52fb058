"""``python -m kvviz.cli ...``, as the ``kvviz`` script."""

import sys

from . import main

sys.exit(main())
