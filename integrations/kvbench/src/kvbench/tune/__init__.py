"""``kvbench tune``: the best method and budget for a memory target, on the user's model and text.

* :mod:`kvbench.tune.source`: the model (registered, a transformers folder or a GGUF file), checked before loading;
* :mod:`kvbench.tune.grid`: the candidate methods and byte levels, the cost estimate and ``--budget-minutes`` trim;
* :mod:`kvbench.tune.frontier`: the Pareto frontier, the winner and its ties, its spec and line of Python;
* :mod:`kvbench.tune.report`: the table, plot and recommendation;
* :mod:`kvbench.tune.cli`: the command (``kvbench tune --help``).

The evaluation itself is kvbench's: :func:`kvbench.run.run_grid` (shared prefills, byte matching, resumable cells)
and :func:`kvbench.paired.pair_rows` (paired bootstrap intervals).
"""
