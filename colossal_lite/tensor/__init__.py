"""Sharding specs for parameters and full/sharded state dicts."""
from .spec import (DimShard, ShardSpec, gather_full, get_spec, set_spec, sharded_parameter,
                   tied_or_new_parameter)
from .state_dict import ShardedModule, local_state_dict

__all__ = ['DimShard', 'ShardSpec', 'gather_full', 'get_spec', 'set_spec', 'sharded_parameter',
           'tied_or_new_parameter', 'ShardedModule', 'local_state_dict']
