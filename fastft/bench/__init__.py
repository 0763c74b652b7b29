"""Benchmarks: one module per op, each with ``run(device, quick) -> list[Row]``; ``python -m fastft bench``
calls them."""
