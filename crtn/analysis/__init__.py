"""Analyses of what a long-range memory helps with, on any corpus (docs/method.md §5).

| module          | what                                                                  |
|-----------------|-----------------------------------------------------------------------|
| ``distance.py`` | loss by distance to the previous occurrence of the target (symbol and  |
|                 | longest n-gram, n <= 4), per stream; ``distance_buckets`` of evaluate() |
| ``recl.py``     | relative effective context length (Dai et al. 2019, appendix, and the  |
|                 | CRTN authors' variant): the relative gain and RECL of a model group,   |
|                 | its table and plot                                                     |
| ``recl_app.py`` | ``crtn-recl``: per-token losses of several checkpoints at growing      |
|                 | context lengths, then RECL                                             |

The package imports nothing here, so that :mod:`crtn.evaluate` can use ``distance`` while
``recl_app`` uses :mod:`crtn.evaluate` without an import cycle.
"""
