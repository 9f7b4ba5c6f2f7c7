"""GPT on the bundled Shakespeare plays (byte tokens), one process, no parallelism.

    colossal-lite train configs/gpt_serial.py
"""
_base_ = '_gpt_shakespeare.py'  # the shared GPT job; this file picks the layout
