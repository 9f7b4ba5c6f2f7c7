"""GPT on the bundled Shakespeare plays, 3D tensor parallel, a 2x2x2 cube, on 8 processes.

    colossal-lite train configs/gpt_3d.py --nproc 8
"""
_base_ = '_gpt_shakespeare.py'  # the shared GPT job; this file picks the layout
parallel = dict(tensor=dict(size=8, mode='3d'))
