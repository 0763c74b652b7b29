"""fastft.kernels: @triton.jit kernels and their launch wrappers, no policy (installed as fastft.kernels).

Importing a submodule imports triton; fastft imports them only when the Triton backend runs.
"""
