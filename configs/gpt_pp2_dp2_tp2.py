"""GPT with data 2 x 2 pipeline stages (zero-bubble schedule) x 1D tensor parallel 2
(8 processes).

    colossal-lite train configs/gpt_pp2_dp2_tp2.py --nproc 8
"""
_base_ = '_gpt_shakespeare.py'
parallel = dict(pipeline=dict(size=2, schedule='zero_bubble'), tensor=dict(size=2, mode='1d'))
num_microbatches = 4
