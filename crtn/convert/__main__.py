"""``python -m crtn.convert``: as ``crtn-convert``."""

from crtn.convert import main

main()
