"""GPT on the bundled plays with 2 pipeline stages (1F1B), 4 micro-batches per step.

    colossal-lite train configs/gpt_pp2.py --nproc 2
"""
_base_ = '_gpt_shakespeare.py'
parallel = dict(pipeline=2)
num_microbatches = 4
