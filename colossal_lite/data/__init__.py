"""Bundled data (no network): the Shakespeare corpus with a byte tokenizer, sklearn digits,
and a data-parallel loader that gives each DATA rank its slice of every global batch."""
from .digits import digits_datasets
from .loader import DataParallelLoader
from .text import (CORPUS_DIR, ByteTokenizer, TokenWindows, corpus_files, load_corpus,
                   text_datasets)

__all__ = ['digits_datasets', 'DataParallelLoader', 'CORPUS_DIR', 'ByteTokenizer',
           'TokenWindows', 'corpus_files', 'load_corpus', 'text_datasets']
