"""fastft.kernels: @triton.jit kernels and their launch wrappers, no policy (installed as fastft.kernels).

Importing an op's module (``kernels/<op>.py``) imports triton; fastft imports those only when the Triton backend
runs. ``_launch`` (the launch path, and the host-side rounding fastft shares) imports no Triton: ``import
fastft`` loads it.
"""
