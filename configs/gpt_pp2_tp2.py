"""GPT with 2 pipeline stages x 1D tensor parallel 2 (4 processes); the stages exchange
1/2 slices of each activation and all-gather them (Megatron's scatter-gather).

    colossal-lite train configs/gpt_pp2_tp2.py --nproc 4
"""
_base_ = '_gpt_shakespeare.py'
parallel = dict(pipeline=2, tensor=dict(size=2, mode='1d'))
num_microbatches = 4
