"""GPT on the bundled Shakespeare plays, data parallel over 2 processes (each takes half of
every global batch of 16).

    colossal-lite train configs/gpt_dp.py --nproc 2
"""
_base_ = '_gpt_shakespeare.py'  # the shared GPT job; this file picks the layout
parallel = dict(data=2)
