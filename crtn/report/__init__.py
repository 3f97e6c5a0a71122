"""``crtn-report``: tables and plots of the runs in a ``crtn-train`` / ``crtn-eval`` sweep.

    crtn-report SWEEP_DIR                  # a Hydra multirun dir (or a single run dir)
    crtn-report SWEEP_A SWEEP_B out=cmp    # several sweeps or runs in one report, written to cmp/
    crtn-report SWEEP_DIR plots=false      # tables only

Arguments are directory paths plus ``key=value`` options (read with ``OmegaConf.from_cli``):
``out`` (where to write; default: the directory itself, or with several directories a
report into each of them), ``plots`` (default true). A job directory is a directory holding
``.hydra/config.yaml``, ``status.json``, ``results.json``, ``eval.json`` or ``metrics.jsonl``;
a sweep directory is one whose sub-directories are job directories (``0/``, ``1/``, ...).

Files written (each only when there is something to show):

- ``report.md``: the tables below in Markdown, with the plots embedded.
- ``report.csv``: one row per ``crtn-train`` job, sorted by job number: job, status, model,
  data, query, summary, n_slot, top_k, tgt_len, mem_len, params, steps, ``valid_<metric>``,
  ``test_<metric>`` (metric ``ppl`` or ``bpc``), on the synthetic corpus the test split's
  ``test_repeat_ppl``, ``test_repeat_acc``, ``test_fresh_ppl``, ``test_fresh_acc`` and where the
  copied source lay (``test_repeat_source_in_memory``, ``..._in_cache``, ``..._retrieved``, those
  that a job measured), on MQAR (a test evaluation with ``answers``) the answers' accuracy,
  perplexity and chance accuracy (``test_answers_acc``, ``test_answers_ppl``,
  ``test_answers_chance_acc``) and the fractions of the answers whose stored pair lay in the
  memory, in the cache, in the retrieved slots of the top retrieving layer and of any retrieving
  layer (``test_pair_in_memory``, ``test_pair_in_cache``, ``test_pair_retrieved``,
  ``test_pair_retrieved_any_layer``, those that a job measured), then ``tokens_per_s``,
  ``train_time_s``, ``note`` and ``overrides`` (the job's command-line overrides). Numbers are copied from ``results.json`` unrounded. Jobs without
  ``results.json`` (failed, running, stopped, unreadable) keep their row, with the status and
  a note: the error message, or the step and time reached.
- ``cache_extension.csv``: one row per ``crtn-eval`` job (a directory with ``eval.json``),
  sorted by checkpoint then ``n_slot``: checkpoint, step, n_slot, top_k, tgt_len, mem_len,
  ``range_tokens`` (mem_len + n_slot * tgt_len, the crtn dependency range) and the metric of
  each evaluated split: the eval-time cache extension of docs/method.md §5. From the final
  (test) evaluation: ``split`` (which one) and the recall and MQAR columns of ``report.csv``
  without ``test_``; ``alpha_mass_mean`` and ``mean_distance_tokens`` (``eval.json``'s
  ``retrieval``: the top retrieving layer's) and, where a job's retrieval lists each retrieving
  layer (``retrieval.layers``, selection inside attention), the same per layer as
  ``alpha_mass_mean_r<i>`` and ``mean_distance_tokens_r<i>``: layer i of n, bottom first (the
  distance plot's ``layer i of n``; ``_r<n>`` repeats the top-level value), as many as the job
  with the most layers, empty for a job with fewer.
- ``search.csv``: the best of each search: training jobs whose overrides differ only in
  ``optim.lr`` form one search; per search, the job with the lowest validation loss, its
  learning rate and metrics, and the validation metric of every rate tried.
- ``seeds.csv``: across seeds: training jobs whose overrides differ only in ``seed`` form one
  configuration (a job that names no seed has its config's); per configuration, the number of
  seeds, the mean and sample standard deviation of the valid and test metric, and each seed's
  test metric.
- ``valid_curves.png``: validation metric against training step and against elapsed
  training time, one line per job (``metrics.jsonl``).
- ``test_bars.png``: final test metric per training job (best checkpoint by validation).
- ``distance_hist.png``: crtn jobs, fraction of cache selections per distance of the
  selected segment in tokens (segments * seg_len), on the final (test) evaluation.
- ``freq_buckets.png``: word-level jobs, test perplexity per training-frequency bucket.
- ``recall.png``: synthetic corpus, perplexity and accuracy on repeat vs fresh tokens.
- ``cache_extension.png``: eval sweeps, metric against eval-time ``n_slot``.
- ``distance_nll_<corpus>.png`` and ``distance_nll.csv`` (a table in ``report.md`` too): loss by
  distance to the previous occurrence of the target, per job, against the corpus's ``txl`` job
  (:mod:`crtn.report.distance`).
- ``distance_seeds.csv`` (a table in ``report.md`` too): the same per configuration of
  ``seeds.csv``, as the mean over its seeds minus the ``txl`` configuration's, with the standard
  error of that difference.
- ``equal_time.csv``, ``equal_tokens.csv`` and ``equal_budget.png`` (tables in ``report.md`` too):
  training jobs that share a wall-clock budget (``train.max_time``), compared at equal time (each
  job's final valid and test metric after the budget) and at equal tokens (each job's validation
  during training at the largest step every job reached; evaluations that do not line up are
  said so, not interpolated), and their validation curves against time and against tokens
  (:mod:`crtn.report.budget`).
- ``cache_effect.csv`` and ``cache_effect_<corpus>.png`` (a table in ``report.md`` too): where
  ``crtn-eval`` evaluated one checkpoint with an empty cache (``eval.n_slot=0``) and with
  caches of other sizes, the cache's own effect per distance bucket, same weights, and each
  bucket's contribution to the change of the mean loss (:mod:`crtn.report.cache_effect`).

Lines and bars keep one colour per job in every plot and are labelled by the job number and
the overrides that differ between jobs. Errors: a missing directory, one without job
directories, or a bad option raises :class:`crtn.errors.UserError` (the command prints
``crtn-report: error: ...`` and exits with status 2). A job file that cannot be parsed does
not stop the report: the job is listed with status ``unreadable: <file>``.
"""

from crtn.report.cli import PROG, ReportOptions, main, parse_args, write_report
from crtn.report.jobs import Job, common_overrides, find_job_dirs, load_jobs, read_job
from crtn.report.tables import eval_table, markdown_table, train_table, write_csv

__all__ = [
    "PROG",
    "Job",
    "ReportOptions",
    "common_overrides",
    "eval_table",
    "find_job_dirs",
    "load_jobs",
    "main",
    "markdown_table",
    "parse_args",
    "read_job",
    "train_table",
    "write_csv",
    "write_report",
]
