"""Profiling and monitoring (notebook 06): TensorBoard behind JupyterLab, profiler traces read with
TensorBoard's PyTorch Profiler plugin, and utilisation sampled beside a batch job.

* ``tensorboard_proxy``: the jupyter-server-proxy entry (``<jupyter url>/tensorboard/``) and its link;
* ``traces``: step-time breakdown, top operators and memory curve of the traces, via the plugin's parser;
* ``utilisation``: the per-node sampler a batch script starts beside training (one CSV per node);
* ``plots``: the notebook's figures.
"""
