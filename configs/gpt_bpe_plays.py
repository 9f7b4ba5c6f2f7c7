"""GPT with a byte-level BPE tokenizer (trained on the text in seconds) on the bundled plays,
read through Hugging Face ``datasets`` -- the path for your own text (``data.type='hf'``,
docs/cli_and_data.md). Data parallel over however many processes ``--nproc`` gives.

    colossal-lite train configs/gpt_bpe_plays.py --nproc 2

For your own files change ``data``: e.g. ``path='json', data_files='my/*.jsonl',
text_column='content'``, or ``tokenizer=dict(type='file', path='tokenizer.json')``.
"""
from colossal_lite.data import corpus_files

imports = ['model_zoo']  # registers gpt/bert/vit (also found through the installed entry point)
model = dict(type='gpt', preset='tiny', hidden=192, layers=3, heads=6, max_positions=128,
             dropout=0.0)    # vocab_size: the tokenizer's, rounded up to a multiple of 128
data = dict(type='hf', path='text', data_files=[str(p) for p in corpus_files()],
            text_column='text', seq_len=128, val_fraction=0.05,
            tokenizer=dict(type='bpe', vocab_size=2048))
train = dict(global_batch_size=16, steps=300, log_every=25, eval_batches=8,
             run_dir='runs/gpt_bpe_plays')    # tokenizer.json, metrics.jsonl, loss.png
optimizer = dict(type='adamw', lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
lr_scheduler = dict(type='cosine', warmup_steps=20, min_lr_ratio=0.1)
clip_grad_norm = 1.0
