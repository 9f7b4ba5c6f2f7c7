"""A tiny random-init Hugging Face Llama (``transformers.LlamaForCausalLM``: grouped-query
attention with 4 query heads sharing 2 key/value heads, RoPE, SwiGLU, RMSNorm; 0.11 M
parameters) on the bundled plays (byte tokens), split by the graph-level planner
(docs/auto_graph.md) over a 2 x 2 device mesh on 4 processes.

    colossal-lite train configs/llama_hf_auto.py --nproc 4

Every rank builds the same model (same seed) and reads the same whole batch;
``auto.parallelize`` captures the model with its loss as one graph, rank 0 solves the plan
(printed at the start) and every rank runs its part of it. The unconstrained plan predicts
8.4 MiB per rank and replicates every weight; the 4 MiB budget below makes the solver shard
some of them (at 5 MiB it still replicates them and splits the activations). ``model = dict(type='hf', path='/local/hf/dir')`` trains a local checkpoint
instead (``from_pretrained(local_files_only=True)``, float32).
"""
model = dict(type='hf', config=dict(
    model_type='llama', vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128))
parallel = dict(auto=dict(level='fast', mesh=dict(data=2, tensor=2), memory_gb=0.004))
data = dict(type='shakespeare', seq_len=64, val_fraction=0.05)
train = dict(global_batch_size=8, steps=20, log_every=5, eval_batches=2,
             run_dir='runs/llama_hf_auto')    # metrics.jsonl, loss.png
optimizer = dict(type='adamw', lr=1e-2, weight_decay=0.01, betas=(0.9, 0.95))
lr_scheduler = dict(type='constant', warmup_steps=2)
clip_grad_norm = 1.0
