"""GPT on the bundled Shakespeare plays, 2D (SUMMA) tensor parallel, q=2, on 4 processes.

    colossal-lite train configs/gpt_2d.py --nproc 4
"""
_base_ = '_gpt_shakespeare.py'  # the shared GPT job; this file picks the layout
parallel = dict(tensor=dict(size=4, mode='2d'))
