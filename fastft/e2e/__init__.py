"""The main job: fine-tuning steps of transformers models, one column per stack (naive glue, stock
transformers, Liger-Kernel, Unsloth, fastft's stacks), on the same weights and stream of fresh packed rows,
with a loss check of fastft against the reference (``python -m fastft e2e``). Layered bottom-up; each module
imports only those above it in this list:

- ``models``: the model table and every fact about a model (MoE, sinks, mixers, tiny configs, token budget);
- ``stream``: the seeded stream of packed rows, and what a step feeds the model (packed or padded);
- ``train``: the harness (AdamW steps, timing, compiles and captures) and one column's record;
- ``quant``: QLoRA's 4-bit models (``--quant nf4``);
- ``stacks``: the columns (``COLUMNS``): how each stack is built, where it runs, whether it leaks documents;
- ``unsloth``: the ``unsloth`` column, in a worker process of its own;
- ``floor``: a step's compute floor (its model FLOPs at the GPU's measured dense GEMM rate);
- ``report``: the table, the loss check and its verdict line, the chart;
- ``run``: the loop over models, streams and columns;
- ``distributed``: the multi-process steps (``--nproc``: DDP, FSDP2, expert parallelism);
- ``command``: the ``e2e`` and ``audit`` commands of ``python -m fastft``.
"""
