"""Placements of tensors over a layout, parameters drawn by name, full/sharded state dicts."""
from .init import (Init, building_on_meta, init_by_name, materialize, name_seed, new_parameter,
                   parameter_bytes, parameter_placement, placements, tied_or_new_parameter)
from .placement import (Placement, layout_mesh, param_placement, placement_of, set_placement,
                        tag, to_dtensor)
from .state_dict import ShardedModule, gather_full, local_state_dict

__all__ = ['Init', 'building_on_meta', 'init_by_name', 'materialize', 'name_seed',
           'new_parameter', 'parameter_bytes', 'parameter_placement', 'placements',
           'tied_or_new_parameter', 'Placement', 'layout_mesh', 'param_placement',
           'placement_of', 'set_placement', 'tag', 'to_dtensor', 'ShardedModule', 'gather_full',
           'local_state_dict']
