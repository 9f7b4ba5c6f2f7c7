"""The main job: GPT on the bundled Shakespeare plays (byte tokens), data parallel 2 x 1D
tensor parallel 2 on 4 processes.

    colossal-lite train configs/gpt_dp2_tp2.py --nproc 4
"""
_base_ = '_gpt_shakespeare.py'  # the shared GPT job; this file picks the layout
parallel = dict(tensor=dict(size=2, mode='1d'))          # data = 4 / (1 * 2) = 2
