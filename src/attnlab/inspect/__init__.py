"""Look inside a model: parameter tables, tensor shapes stage by stage, attention maps."""

from .params import parameter_table
from .shapes import trace_shapes

__all__ = ["parameter_table", "trace_shapes"]
