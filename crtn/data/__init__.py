"""Data: corpora, vocabularies, the synthetic passage-recall and associative-recall (MQAR) corpora and
the segment iterator (docs/method.md §4).

Public API::

    from crtn.data import load_corpus, Corpus, Vocab, StreamIterator, Batch

    corpus = load_corpus(cfg.data)
    it = StreamIterator(corpus.splits["train"], batch_size, tgt_len, drop_last=True)
    for batch in it.iterate(start=0):
        batch.input, batch.target  # int64 [B, L'] batch-first
"""

from crtn.data.base import Corpus
from crtn.data.corpus import cache_dir_for, load_corpus
from crtn.data.iterator import Batch, StreamIterator
from crtn.data.mqar import make_mqar
from crtn.data.spec import DATASETS, DEFAULT_DIRS, DataSpec, MqarSpec, SyntheticSpec, resolve_data
from crtn.data.synthetic import MarkovSource, make_synthetic
from crtn.data.vocab import EOS, UNK, Vocab

__all__ = [
    "DATASETS",
    "DataSpec",
    "MqarSpec",
    "SyntheticSpec",
    "DEFAULT_DIRS",
    "EOS",
    "UNK",
    "Batch",
    "Corpus",
    "MarkovSource",
    "StreamIterator",
    "Vocab",
    "cache_dir_for",
    "load_corpus",
    "make_mqar",
    "make_synthetic",
    "resolve_data",
]
