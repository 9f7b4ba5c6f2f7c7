"""A tiny Mixtral -- a Llama whose MLPs are mixtures of 4 SwiGLU experts, top-2 routing,
softmax + renormalized weights, the load-balancing aux loss (coef 0.01) and DeepSeek-V3
bias balancing -- on the bundled Shakespeare plays (byte-level), data parallel over 2
replicas with the experts split over 2 expert ranks (parallel.expert=2: each process holds
2 of the 4 experts of every layer; tokens travel by all_to_all over EXPERT).

    colossal-lite train configs/mixtral_plays.py --nproc 2
    colossal-lite train configs/mixtral_plays.py --nproc 4 --steps 20   # + data x 2 (E=2)

The progress line shows the loss and the tokens per expert of the step (routed slots,
min/mean/max over the experts of every MoE layer, docs/moe.md "Logging"), the aux loss and
the worst layer's max/mean; metrics.jsonl records them per step.
"""
imports = ['model_zoo']  # registers the models (also found through the installed entry point)
model = dict(type='llama', preset='tiny', hidden=128, layers=3, heads=4, kv_heads=2,
             intermediate=256, max_positions=128, dropout=0.0,
             moe=dict(experts=4, top_k=2, aux_loss_coef=0.01, bias_update_rate=0.01))
parallel = dict(expert=2)          # data = processes (2 or 4); E=2 is carved out of it
data = dict(type='shakespeare', seq_len=128, val_fraction=0.05)
train = dict(global_batch_size=16, steps=300, log_every=5, eval_batches=8,
             run_dir='runs/mixtral_plays')   # metrics.jsonl, loss.png
optimizer = dict(type='adamw', lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
lr_scheduler = dict(type='cosine', warmup_steps=20, min_lr_ratio=0.1)
clip_grad_norm = 1.0
checkpoint = dict(path='runs/mixtral_plays/ckpt', interval=100)
