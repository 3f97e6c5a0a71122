"""``python -m crtn.bench``: as ``crtn-bench``."""

from crtn.bench import main

main()
