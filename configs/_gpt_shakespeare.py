"""The GPT job every configs/gpt_*.py file runs; each of them only picks the layout.

Byte-level GPT (1.41 M parameters) on the bundled Shakespeare plays, 300 steps.
"""
imports = ['model_zoo']  # registers gpt/bert/vit (also found through the installed entry point)
model = dict(type='gpt', preset='tiny', hidden=192, layers=3, heads=6, max_positions=128,
             dropout=0.0)
data = dict(type='shakespeare', seq_len=128, val_fraction=0.05)
train = dict(global_batch_size=16, steps=300, log_every=25, eval_batches=8)
optimizer = dict(type='adamw', lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
lr_scheduler = dict(type='cosine', warmup_steps=20, min_lr_ratio=0.1)
clip_grad_norm = 1.0
checkpoint = dict(path='runs/ckpt', interval=100)  # resumable: colossal-lite train ... --resume runs/ckpt
