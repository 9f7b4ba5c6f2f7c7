"""GPT on the bundled Shakespeare plays, 2.5D tensor parallel, q=2 and depth 2, on 8 processes.

    colossal-lite train configs/gpt_2p5d.py --nproc 8
"""
_base_ = '_gpt_shakespeare.py'  # the shared GPT job; this file picks the layout
parallel = dict(tensor=dict(size=8, mode='2.5d', depth=2))
