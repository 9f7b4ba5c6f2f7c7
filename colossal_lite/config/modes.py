"""The named process groups of a parallel layout (a vocabulary: imports nothing)."""
from enum import Enum


class ParallelMode(Enum):
    """One member per kind of process group the library builds.

    GLOBAL is every rank. DATA, PIPELINE and TENSOR are the three axes of the
    layout ``world = data * pipeline * tensor``. The remaining members are the
    sub-groups of the tensor axis used by one tensor-parallel family each.
    """

    GLOBAL = 'global'
    DATA = 'data'
    PIPELINE = 'pipe'
    TENSOR = 'tensor'
    # first and last pipeline stage of one pipeline group: sums the gradient of a weight
    # both hold (GPT's token embedding tied to its LM head); one rank when pipeline == 1
    EMBEDDING = 'embedding'

    # expert parallelism (mixture of experts): the data axis unfolds into
    # expert_data (outer, data / E) x expert (inner, E consecutive data coordinates).
    # EXPERT holds the E ranks whose experts differ (all-to-all of tokens);
    # EXPERT_DATA holds the data replicas of one expert shard (its gradient sum).
    # With expert == 1: EXPERT is one rank, EXPERT_DATA equals DATA.
    EXPERT = 'expert'
    EXPERT_DATA = 'expert_data'

    # sequence parallelism: SEQUENCE is the tensor axis, SEQUENCE_DP = data x sequence
    SEQUENCE = 'sequence'
    SEQUENCE_DP = 'sequence_dp'
    # mode 'ulysses': the SEQUENCE group is ring x ulysses; all-to-all inside ULYSSES (inner,
    # consecutive ranks), ring attention over SEQUENCE_RING (one rank per ULYSSES group)
    ULYSSES = 'ulysses'
    SEQUENCE_RING = 'sequence_ring'

    PARALLEL_1D = '1d'

    PARALLEL_2D_ROW = '2d_row'
    PARALLEL_2D_COL = '2d_col'

    PARALLEL_2P5D_ROW = '2p5d_row'
    PARALLEL_2P5D_COL = '2p5d_col'
    PARALLEL_2P5D_DEP = '2p5d_dep'
    PARALLEL_2P5D_XZ = '2p5d_xz'

    PARALLEL_3D_INPUT = '3d_input'
    PARALLEL_3D_WEIGHT = '3d_weight'
    PARALLEL_3D_OUTPUT = '3d_output'
    PARALLEL_3D_INPUT_X_WEIGHT = '3d_input_x_weight'
    PARALLEL_3D_OUTPUT_X_WEIGHT = '3d_output_x_weight'
