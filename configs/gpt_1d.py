"""GPT on the bundled Shakespeare plays, 1D (Megatron) tensor parallel over 2 processes.

    colossal-lite train configs/gpt_1d.py --nproc 2
"""
_base_ = '_gpt_shakespeare.py'  # the shared GPT job; this file picks the layout
parallel = dict(tensor=dict(size=2, mode='1d'))
