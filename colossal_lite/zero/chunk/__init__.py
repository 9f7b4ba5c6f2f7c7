"""Chunk-based ZeRO (stage 3, Gemini): chunks with tensor states (``chunk.py``), the chunk
manager (``manager.py``), placement policies and device accounting (``placement.py``), the
warm-up memory tracer (``tracer.py``), the chunk-size search (``search.py``), models built
straight into chunks (``lazy.py``) and the Engine wiring (``engine.py``). ``docs/zero.md``
has the states, the policies and the formulas."""
from .chunk import Chunk, IllegalTransition, TensorState
from .lazy import building_into_chunks
from .placement import DeviceBudgetExceeded, DeviceLedger
from .search import ChunkSearchResult, packed_waste, search_chunk_size

__all__ = ['Chunk', 'ChunkSearchResult', 'DeviceBudgetExceeded', 'DeviceLedger',
           'IllegalTransition', 'TensorState', 'building_into_chunks', 'packed_waste',
           'search_chunk_size']
