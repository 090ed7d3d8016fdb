"""The ways a step's forward pass can be computed, behind one protocol (base.py): the model's modules (always), the
fused decode stack over Python lists or over the KV backend's metadata (stack.py), and CUDA graph replays
(graphs.py). The runner asks each, in its order, whether it supports the step's plan, and runs the first that does.
A decode run (several steps in one call) is the decode stack's too (`DecodeRunPath`)."""

from tokenmill.forward.base import Forward, ForwardPath, Rows, flatten
from tokenmill.forward.graphs import GraphsPath
from tokenmill.forward.modules import ModulesPath
from tokenmill.forward.stack import DecodeRunPath, StackListsPath, StackMetadataPath

__all__ = [
    "DecodeRunPath",
    "Forward",
    "ForwardPath",
    "GraphsPath",
    "ModulesPath",
    "Rows",
    "StackListsPath",
    "StackMetadataPath",
    "flatten",
]
