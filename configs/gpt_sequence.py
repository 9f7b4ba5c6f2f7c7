"""GPT on the bundled Shakespeare plays, sequence parallel (ring self-attention) over 4 sub-sequences, on 4 processes.

    colossal-lite train configs/gpt_sequence.py --nproc 4
"""
_base_ = '_gpt_shakespeare.py'  # the shared GPT job; this file picks the layout
parallel = dict(tensor=dict(size=4, mode='sequence'))
