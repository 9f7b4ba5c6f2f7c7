"""Bundled data (no network): the Shakespeare corpus with a byte tokenizer, sklearn digits,
a data-parallel loader that gives each DATA rank its slice of every global batch, and
packing of several documents per row (``packing.py``)."""
from .digits import digits_datasets
from .loader import DataParallelLoader
from .packing import pack_documents, packed_labels
from .text import (CORPUS_DIR, ByteTokenizer, TokenWindows, corpus_files, load_corpus,
                   text_datasets)

__all__ = ['digits_datasets', 'DataParallelLoader', 'CORPUS_DIR', 'ByteTokenizer',
           'TokenWindows', 'corpus_files', 'load_corpus', 'text_datasets', 'pack_documents',
           'packed_labels']
