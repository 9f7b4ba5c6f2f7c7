"""2D (SUMMA, q=2 on 4 ranks) equals serial: every layer, GPT/BERT/ViT, data parallel x 2D."""
import pytest
import torch

import colossal_lite.nn as col_nn
from colossal_lite.context import ParallelMode, ProcessGroupAxis
from colossal_lite.nn.parallel_2p5d import Grid2p5D, Linear2p5D
from colossal_lite.formulas import linear_2p5d_bytes, linear_2p5d_wire_bytes

from tests._tp_grid_cases import B, H, S, run_layer_checks, run_model_checks

CFG_2D = dict(parallel=dict(tensor=dict(size=4, mode='2d')))


def test_2d_layers_equal_serial_and_linear_bytes_match_formula():
    for measured, wire in run_layer_checks(4, CFG_2D, grid_shape=(2, 2)):
        assert measured == linear_2p5d_bytes(B, S, H, q=2, d=1)
        assert abs(wire - linear_2p5d_wire_bytes(B, S, H, q=2, d=1)) < 1e-6


def test_2d_gpt_bert_vit_equal_serial_after_3_adamw_steps():
    run_model_checks(4, CFG_2D)


def test_data_parallel_x_2d_equals_serial():
    run_model_checks(8, CFG_2D)


def _fake_grid(q):
    """A q x q grid description for checks that fail before any collective."""
    def axis(mode, rank):
        return ProcessGroupAxis(mode, None, tuple(range(q)), rank, q)
    return Grid2p5D(axis(ParallelMode.PARALLEL_2D_ROW, 0), axis(ParallelMode.PARALLEL_2D_COL, 1),
                    ProcessGroupAxis.serial(ParallelMode.PARALLEL_2P5D_DEP))


def test_2d_divisibility_errors_name_the_numbers():
    grid = _fake_grid(2)
    with pytest.raises(ValueError, match=r'in_features.*15 is not divisible by 2'):
        Linear2p5D(15, 16, grid=grid)
    with pytest.raises(ValueError, match=r'batch divisible by d\*q = 1\*2 = 2, got 3'):
        col_nn.parallel_2p5d.Embedding2p5D(10, 8, grid=grid)(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r'num_embeddings.*33 is not divisible by 2'):
        col_nn.parallel_2p5d.VocabParallelEmbedding2p5D(33, 8, grid=grid)
    with pytest.raises(ValueError, match=r'head count divisible by 2'):
        col_nn.parallel_2p5d.AttentionCore2p5D(4, grid=grid)(*(torch.zeros(2, 3, 6),) * 3)
    with pytest.raises(ValueError, match="region"):
        Linear2p5D(16, 16, region='middle', grid=grid)
