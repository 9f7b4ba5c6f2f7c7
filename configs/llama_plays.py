"""A small Llama (grouped-query attention: 6 query heads share 2 key/value heads, RoPE,
SwiGLU, RMSNorm) with a byte-level BPE tokenizer on the bundled plays, read through Hugging
Face ``datasets`` (the data and tokenizer sections of configs/gpt_bpe_plays.py), split by
1D tensor parallelism over 2 processes (each holds 3 query heads and 1 kv head); more
processes add data parallelism.

    colossal-lite train configs/llama_plays.py --nproc 2
    colossal-lite generate runs/llama_plays/ckpt --prompt "ROMEO:" --tokens 60 --nproc 2
    colossal-lite export runs/llama_plays/ckpt --hf runs/llama_plays/hf   # a LlamaForCausalLM
"""
from colossal_lite.data import corpus_files

imports = ['model_zoo']  # registers the models (also found through the installed entry point)
model = dict(type='llama', preset='tiny', hidden=192, layers=3, heads=6, kv_heads=2,
             intermediate=512, max_positions=128, dropout=0.0)
# vocab_size: the tokenizer's, rounded up to a multiple of 128
parallel = dict(tensor=dict(size=2, mode='1d'))
data = dict(type='hf', path='text', data_files=[str(p) for p in corpus_files()],
            text_column='text', seq_len=128, val_fraction=0.05,
            tokenizer=dict(type='bpe', vocab_size=2048))
train = dict(global_batch_size=16, steps=300, log_every=25, eval_batches=8,
             run_dir='runs/llama_plays')    # tokenizer.json, metrics.jsonl, loss.png
optimizer = dict(type='adamw', lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
lr_scheduler = dict(type='cosine', warmup_steps=20, min_lr_ratio=0.1)
clip_grad_norm = 1.0
checkpoint = dict(path='runs/llama_plays/ckpt', interval=100)
