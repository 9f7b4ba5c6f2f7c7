"""ViT tiny on scikit-learn's 8x8 digits (shipped with scikit-learn), data parallel 2 x 1D
tensor parallel 2 on 4 processes; prints test accuracy after every epoch.

    colossal-lite train configs/vit_digits.py --nproc 4      (or --nproc 1 with parallel removed)
"""
parallel = dict(tensor=dict(size=2, mode='1d'))
imports = ['model_zoo']  # registers gpt/bert/vit (also found through the installed entry point)
model = dict(type='vit', preset='tiny', hidden=64, layers=2, heads=4, dropout=0.0)
data = dict(type='digits', test_fraction=0.2)
train = dict(global_batch_size=32, epochs=10, log_every=40)
optimizer = dict(type='adamw', lr=4e-3, weight_decay=0.01)
lr_scheduler = dict(type='cosine', warmup_steps=20, min_lr_ratio=0.05)
