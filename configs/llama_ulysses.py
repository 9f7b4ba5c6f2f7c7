"""The small Llama of configs/llama_plays.py on longer sequences (512 tokens), split over 4
processes by the ring x Ulysses hybrid: Ulysses' all-to-all over 2 ranks (each attends with
3 of the 6 query heads and 1 of the 2 kv heads over its pair's tokens), ring attention with
zigzag chunks over the 2 pairs.

    colossal-lite train configs/llama_ulysses.py --nproc 4
"""
from colossal_lite.data import corpus_files

_base_ = 'llama_plays.py'
model = dict(type='llama', preset='tiny', hidden=192, layers=3, heads=6, kv_heads=2,
             intermediate=512, max_positions=512, dropout=0.0)
parallel = dict(tensor=dict(size=4, mode='ulysses', ring=2))   # ring=1: pure Ulysses
data = dict(type='hf', path='text', data_files=[str(p) for p in corpus_files()],
            text_column='text', seq_len=512, val_fraction=0.05,
            tokenizer=dict(type='bpe', vocab_size=2048))
train = dict(global_batch_size=4, steps=100, log_every=10, eval_batches=4,
             run_dir='runs/llama_ulysses')
checkpoint = dict(path='runs/llama_ulysses/ckpt', interval=50)
