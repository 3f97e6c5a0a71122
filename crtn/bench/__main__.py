"""``python -m crtn.bench``: as ``crtn-bench``."""

import sys

from crtn.bench import main

sys.exit(main())
