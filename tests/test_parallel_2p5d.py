"""2.5D equals serial: layers at q=2 d=2 (8 ranks); GPT/BERT/ViT at q=2 d=1 and q=2 d=2."""
from colossal_lite.formulas import linear_2p5d_bytes, linear_2p5d_wire_bytes

from tests._tp_grid_cases import B, H, S, run_layer_checks, run_model_checks


def _cfg(depth):
    return dict(parallel=dict(tensor=dict(size=4 * depth, mode='2.5d', depth=depth)))


def test_2p5d_depth2_layers_equal_serial_and_linear_bytes_match_formula():
    for measured, wire in run_layer_checks(8, _cfg(2), grid_shape=(4, 2)):
        assert measured == linear_2p5d_bytes(B, S, H, q=2, d=2)
        assert abs(wire - linear_2p5d_wire_bytes(B, S, H, q=2, d=2)) < 1e-6


def test_2p5d_depth1_models_equal_serial():
    run_model_checks(4, _cfg(1))


def test_2p5d_depth2_models_equal_serial():
    run_model_checks(8, _cfg(2))
