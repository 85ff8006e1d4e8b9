"""`unbroken simulate`: what recovery is worth for one training job at N GPUs.

A Monte Carlo over seeded failure draws, vectorised with numpy across seeds (`engine`):
the same draws go through each recovery strategy (common random numbers), so differences
between strategies are not sampling noise. The model, its inputs and what it leaves out
are in docs/simulate.md.
"""
