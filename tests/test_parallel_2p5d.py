"""2.5D equals serial: layers at q=2 d=2 (8 ranks); GPT/BERT/ViT at q=2 d=1 and q=2 d=2."""
from colossal_lite.formulas import linear_2p5d_bytes, linear_2p5d_wire_bytes
from colossal_lite.testing import run_distributed

from tests._tp_grid_cases import (B, H, S, TOL, LAYER_CASES, check_dropout, check_layers,
                                  check_models,
                                  layer_references, model_references)
from tests.test_parallel_2d import _assert_models


def _cfg(depth):
    return dict(parallel=dict(tensor=dict(size=4 * depth, mode='2.5d', depth=depth)))


def test_2p5d_depth2_layers_equal_serial_and_linear_bytes_match_formula():
    refs = layer_references()
    results = run_distributed(check_layers, 8, _cfg(2), refs, (B, S, H), timeout=300)
    for rank, res in enumerate(results):
        assert set(res['diffs']) == set(LAYER_CASES)
        for name, diff in res['diffs'].items():
            assert diff <= TOL, f'rank {rank} {name} differs by {diff:.3g}'
        check_dropout(*res['dropout'], grid_shape=(4, 2))
        measured, wire = res['bytes']
        assert measured == linear_2p5d_bytes(B, S, H, q=2, d=2)
        assert abs(wire - linear_2p5d_wire_bytes(B, S, H, q=2, d=2)) < 1e-6


def test_2p5d_depth1_models_equal_serial():
    refs = model_references()
    _assert_models(run_distributed(check_models, 4, _cfg(1), refs, timeout=300), 4)


def test_2p5d_depth2_models_equal_serial():
    refs = model_references()
    _assert_models(run_distributed(check_models, 8, _cfg(2), refs, timeout=300), 8)
