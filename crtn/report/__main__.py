"""``python -m crtn.report``: as ``crtn-report``."""

from crtn.report import main

main()
