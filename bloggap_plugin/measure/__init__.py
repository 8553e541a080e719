"""Measurements that need a loaded model (transformers), below the commands that print them.

- :mod:`~bloggap_plugin.measure.rollouts`: sampling rollouts from the model itself, the prompt sets;
- :mod:`~bloggap_plugin.measure.attribution`: per-layer divergence on calibration rollouts (``bloggap attribute``);
- :mod:`~bloggap_plugin.measure.precision_ladder`: the precision ladder (``bloggap ladder``);
- :mod:`~bloggap_plugin.measure.doctor_matrix`: the doctor's scoring matrix and its result record (``bloggap doctor``);
- :mod:`~bloggap_plugin.measure.doctor_vllm`: the doctor's vLLM sampler column (vLLM built as TRL's colocate engine).

The maths they run lives in :mod:`bloggap_plugin.core` (torch only); benchmarks import these modules, never
``bloggap_plugin.commands``.
"""
