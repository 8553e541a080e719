"""The ground floor: torch maths and the vocabulary everything above shares; imports nothing outside ``core``.

Scoring (:mod:`.scoring`), the scoring plans (:mod:`.plans`) and the model parts they copy (:mod:`.model_parts`,
:mod:`.sharding`), metrics, truncation, the doctor's probe maths (:mod:`.probe`, :mod:`.comparisons`,
:mod:`.recommend`), per-layer divergence (:mod:`.divergence`), arms I and J's vLLM form, kernels, backward
passes and supported versions (:mod:`.vllm`), and the arm records (:mod:`.arms`) and the error type
(:mod:`.errors`) that all of them use.
``tests/root/test_import_layers.py`` holds the layer order.
"""
